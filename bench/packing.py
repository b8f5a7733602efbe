"""Learner tokens/s on GRPO-like uneven lengths: packed micro-batches against padded ones, side by side.

    DS_ACCELERATOR=cpu .venv/bin/python bench/packing.py [--steps 4] [--out bench/results/learner-packing.json]

Builds a random Qwen3-architecture model (``examples.tiny.tiny_qwen3``, 25M
parameters by default) and two ``learner.engine.LearnerEngine`` in one
process, identical but for ``learner.packing``: padding-free micro-batches
(one packed row per micro-batch, per-sequence attention) and padded ones (one
right-padded row per sequence, micro-batches bucketed by length: the learner
before packing). Both get the same micro-batch budget, the same logit chunk
and the same batches, GRPO-like: ``--groups`` groups of ``--group-size``
completions behind a shared prompt of 16-128 tokens, completion lengths
long-tailed (exponential around a quarter of ``--max-tokens``, and one in
seven cut at ``--max-tokens``, as truncated completions are). After a warm-up
step each, the engines take turns, step by step (the machine is shared, so
interleaving keeps the load the same for both), and the table gives real
(prompt + completion) tokens per second of optimizer-step time, the tokens
the model computed (padding included) and the micro-batches per step. The
steps' losses are printed too: the two layouts train the same objective.

A second table times one attention layer alone (forward and backward, the
model's heads and head size) on the first timed step's micro-batches: the packed
row with transformers' own packed-sequence mask (a dense ``N x N`` mask
derived from the position ids, what SDPA gets without ``learner.packing``'s
attention), the packed row with that attention (causal SDPA per sequence),
and the padded rows.

Target (issue 24): packed >= 1.3x padded learner tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def grpo_groups(vocab: int, groups: int, group_size: int, max_tokens: int, seed: int):
    """Trajectory groups with GRPO-like lengths (module docstring); rewards vary within each group."""
    from services.wire import ScoredSample, TrajectoryGroup

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))]
        samples = []
        for i in range(group_size):
            cut = rng.random() < 1 / 7
            n = max_tokens if cut else max(1, min(max_tokens, int(rng.expovariate(4 / max_tokens))))
            samples.append(ScoredSample(token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                                        logprobs=[-rng.uniform(3.0, 6.0) for _ in range(n)], text="",
                                        finish_reason="length" if cut else "stop", policy_version=0,
                                        reward=float(i % 2), status="ok"))
        out.append(TrajectoryGroup(run_id="bench", group_id=f"p{seed}-{g}", prompt="", prompt_token_ids=prompt,
                                   samples=samples, n=group_size, policy_version=0))
    return out


def computed_tokens(engine, seqs) -> tuple[int, int]:
    """(tokens the model runs on, micro-batches) for ``seqs`` in ``engine``'s layout."""
    from learner.batch import bucket, pack

    if engine.packed:
        mbs = pack(seqs, engine.cfg.learner.micro_batch_tokens)
        return sum(s.length for s in seqs), len(mbs)
    mbs = bucket(seqs, engine.cfg.learner.micro_batch_tokens)
    return sum(len(mb) * max(s.length for s in mb) for mb in mbs), len(mbs)


def attention_seconds(packed: list[list[int]], padded: list[list[int]], heads: int, kv_heads: int, head_dim: int,
                      repeats: int = 3) -> dict[str, float]:
    """Seconds of one attention layer's forward + backward over the ``packed`` micro-batches (lists of
    sequence lengths) in the two packed layouts, and over the ``padded`` ones (module docstring); the
    median of ``repeats`` interleaved rounds."""
    import statistics

    import torch
    import torch.nn.functional as F

    from learner.packing import packed_attention

    class Layer(torch.nn.Module):  # what sdpa_attention_forward reads of an attention module
        num_key_value_groups = heads // kv_heads
        is_causal = True

    layer = Layer()

    def qkv(b: int, n: int):
        g = torch.Generator().manual_seed(n)
        return [torch.randn(b, h, n, head_dim, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads)]

    def dense(lens):
        q, k, v = qkv(1, sum(lens))
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        pos = torch.arange(len(seq))
        mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None]).sum().backward()

    def per_sequence(lens):
        q, k, v = qkv(1, sum(lens))
        packed_attention(layer, q, k, v, None, packed_seq_lens=tuple(lens))[0].sum().backward()

    def pad(lens):
        q, k, v = qkv(len(lens), max(lens))
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    times: dict[str, list[float]] = {"packed, dense mask": [], "packed, per sequence": [], "padded": []}
    for _ in range(repeats):
        for name, fn, mbs in zip(times, (dense, per_sequence, pad), (packed, packed, padded), strict=True):
            t0 = time.perf_counter()
            for lens in mbs:
                fn(lens)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192, help="Both engines' budget (the learner's default).")
    ap.add_argument("--stage", type=int, default=0, help="ZeRO stage of both engines.")
    ap.add_argument("--steps", type=int, default=4, help="Timed steps per engine (after one warm-up step each).")
    ap.add_argument("--out", type=Path, default=RESULTS / "learner-packing.json")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import torch

    from examples.tiny import parameter_count, tiny_qwen3
    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from services.config import RunConfig

    work = Path(tempfile.mkdtemp(prefix="tandem-bench-packing-"))
    model = tiny_qwen3(work / "model", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                       head_dim=args.hidden // 8, intermediate=args.hidden * 3, max_positions=1024)
    params = parameter_count(model)
    engines = {}
    for layout in ("packed", "padded"):
        cfg = RunConfig.model_validate({
            "name": "bench", "model": {"path": str(model), "max_model_len": 1024}, "data": {"train": "unused"},
            "sampling": {"max_tokens": args.max_tokens, "group_size": args.group_size},
            "learner": {"zero_stage": args.stage, "lr": 1e-5, "micro_batch_tokens": args.micro_batch_tokens,
                        "packing": layout == "packed"},
        })
        engines[layout] = LearnerEngine(cfg)
        assert engines[layout].packed == (layout == "packed")
    print(f"model: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), ZeRO-{args.stage}, "
          f"micro-batch budget {args.micro_batch_tokens} tokens, torch threads {torch.get_num_threads()}", flush=True)

    rows = {k: {"seconds": 0.0, "tokens": 0, "computed": 0, "micro_batches": 0, "losses": []} for k in engines}
    first = None
    for step in range(args.steps + 1):
        groups = grpo_groups(engines["packed"].vocab_size, args.groups, args.group_size, args.max_tokens, seed=step)
        seqs = build_batch(groups, engines["packed"].cfg.loss, args.max_tokens)
        first = seqs if step == 1 else first
        for layout, engine in engines.items():
            t0 = time.perf_counter()
            stats = engine.train_step(seqs)
            dt = time.perf_counter() - t0
            computed, mbs = computed_tokens(engine, seqs)
            assert mbs == stats["micro_batches"], (mbs, stats)
            print(f"  step {step} {layout}: {dt:6.2f} s, {sum(s.length for s in seqs)} tokens "
                  f"({computed} computed, {mbs} micro-batches), loss {stats['loss']:+.6f}"
                  f"{' (warm-up)' if step == 0 else ''}", flush=True)
            if step == 0:
                continue  # allocators and DeepSpeed's lazy state
            r = rows[layout]
            r["seconds"] += dt
            r["tokens"] += sum(s.length for s in seqs)
            r["computed"] += computed
            r["micro_batches"] += mbs
            r["losses"].append(stats["loss"])
    for r in rows.values():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
    ratio = rows["packed"]["tokens_per_s"] / rows["padded"]["tokens_per_s"]

    print()
    print(f"{'layout':8} {'tokens/s':>9} {'s/step':>7} {'real tokens/step':>16} {'computed/step':>13} "
          f"{'micro-batches/step':>18}")
    for layout, r in rows.items():
        n = args.steps
        print(f"{layout:8} {r['tokens_per_s']:9.0f} {r['seconds'] / n:7.2f} {r['tokens'] / n:16.0f} "
              f"{r['computed'] / n:13.0f} {r['micro_batches'] / n:18.1f}")
    print(f"\npacked / padded learner tokens/s: {ratio:.2f}x (target >= 1.3x); largest loss difference "
          f"{max(abs(a - b) for a, b in zip(rows['packed']['losses'], rows['padded']['losses'], strict=True)):.1e}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    from learner.batch import bucket, pack

    mbs = [[s.length for s in mb] for mb in pack(first, args.micro_batch_tokens)]
    padded_mbs = [[s.length for s in mb] for mb in bucket(first, args.micro_batch_tokens)]
    attention = attention_seconds(mbs, padded_mbs, heads=8, kv_heads=4, head_dim=args.hidden // 8)
    print(f"\none attention layer, forward + backward, over step 1's micro-batches ({sum(map(sum, mbs))} tokens; "
          f"{len(mbs)} packed, {len(padded_mbs)} padded), median of 3 rounds:")
    for name, sec in attention.items():
        print(f"  {name:22} {sec:7.3f} s  ({sec / attention['packed, per sequence']:.2f}x per sequence)")
    report = {"hardware": {"python": platform.python_version(), "torch": torch.__version__,
                           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "load_average": os.getloadavg()[0]},
              "model": {"parameters": params, "hidden": args.hidden, "layers": args.layers},
              "batch": {"groups": args.groups, "group_size": args.group_size, "max_tokens": args.max_tokens,
                        "micro_batch_tokens": args.micro_batch_tokens, "zero_stage": args.stage,
                        "steps": args.steps},
              "layouts": rows, "packed_over_padded": ratio,
              "attention_layer_s": {"packed_micro_batches": mbs, "padded_micro_batches": padded_mbs, **attention}}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    for engine in engines.values():
        engine.engine.destroy()


if __name__ == "__main__":
    main()
