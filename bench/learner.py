"""Learner benchmark: training tokens/s under ZeRO-0/2/3, and publish speed vs the disk.

    DS_ACCELERATOR=cpu .venv/bin/python bench/learner.py [--layers 8 --hidden 512] [--steps 3]

Builds a Qwen3-architecture model of at least 20M parameters from code
(``examples.tiny.tiny_qwen3``, scaled up), then in one run:

1. for each ZeRO stage 0, 2, 3: trains ``--steps`` GRPO steps on synthetic
   trajectory groups (after one warm-up step) and reports training tokens/s;
2. for each stage: publishes the weights exactly as the learner does
   (``LearnerEngine.full_state_dict`` - a ZeRO-3 gather for stage 3 - then
   ``services.weightstore.write_version``, the learner's publish writer:
   ``safetensors.torch.save_file``, fsync beside the sha256, record, rename)
   and reports seconds and GB/s;
3. side by side on the same state dict and disk: ``torch.save`` + fsync,
   ``safetensors.torch.save_file`` + fsync (the library write alone: tandem's
   publish adds the checksum, the record and the rename), and a raw
   ``dd``-style write of the same number of bytes from memory (16 MiB
   ``os.write`` chunks + fsync: the physical limit).

The target: publishing at >= 50% of the raw write speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic(vocab: int, groups: int, group_size: int, completion: int, seed: int):
    from services.wire import ScoredSample, TrajectoryGroup

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(32)]
        samples = [
            ScoredSample(token_ids=[rng.randrange(3, vocab) for _ in range(completion)],
                         logprobs=[-rng.uniform(3, 5) for _ in range(completion)], text="", finish_reason="stop",
                         policy_version=0, reward=float(i % 2), status="ok")
            for i in range(group_size)
        ]
        out.append(TrajectoryGroup(run_id="bench", group_id=f"b{seed}-{g}", prompt="", prompt_token_ids=prompt,
                                   samples=samples, n=group_size, policy_version=0))
    return out


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` from memory in 16 MiB chunks and fsync (what ``dd conv=fsync`` does)."""
    chunk = os.urandom(16 << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = os.write(fd, memoryview(chunk)[: min(left, len(chunk))])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--completion", type=int, default=96)
    ap.add_argument("--stages", default="0,2,3")
    ap.add_argument("--repeats", type=int, default=3, help="Rounds of the side-by-side write comparison.")
    ap.add_argument("--workdir", type=Path, default=None, help="Where models and versions are written (default: a temp dir).")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import torch
    from safetensors.torch import save_file

    from examples.tiny import parameter_count, tiny_qwen3
    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from services import weightstore as store
    from services.config import RunConfig

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-bench-"))
    model_dir = tiny_qwen3(work / "model", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                           head_dim=args.hidden // 8, intermediate=args.hidden * 3)
    params = parameter_count(model_dir)
    print(f"model: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), torch threads {torch.get_num_threads()}")
    assert params >= 20e6, "the benchmark model must have at least 20M parameters"

    rows = []
    publish_rows = []
    for stage in [int(s) for s in args.stages.split(",")]:
        cfg = RunConfig.model_validate({
            "name": "bench", "model": {"path": str(model_dir), "max_model_len": 512}, "data": {"train": "unused"},
            "sampling": {"max_tokens": args.completion},
            "learner": {"zero_stage": stage, "lr": 1e-5, "micro_batch_tokens": 2048},
        })
        engine = LearnerEngine(cfg)
        tokens = 0
        elapsed = 0.0
        for step in range(args.steps + 1):
            seqs = build_batch(synthetic(engine.vocab_size, args.groups, args.group_size, args.completion, step),
                               cfg.loss, cfg.sampling.max_tokens)
            t0 = time.perf_counter()
            engine.train_step(seqs)
            dt = time.perf_counter() - t0
            if step > 0:  # step 0 warms up allocators and DeepSpeed's lazy state
                tokens += sum(s.length for s in seqs)
                elapsed += dt
        rows.append({"stage": stage, "tokens_per_s": tokens / elapsed, "step_s": elapsed / args.steps})
        print(f"ZeRO-{stage}: {tokens / elapsed:,.0f} training tokens/s ({elapsed / args.steps:.2f} s/step, {tokens // args.steps} tokens/step, load average {os.getloadavg()[0]:.1f})", flush=True)

        t0 = time.perf_counter()
        state = engine.full_state_dict(torch.float32)
        gather_s = time.perf_counter() - t0
        written = store.write_version(work / f"weights-zero{stage}", 1, state, step=args.steps, replace=True)
        publish_rows.append({"stage": stage, "bytes": written.bytes, "gather_s": gather_s, "write_s": written.seconds,
                             "total_s": gather_s + written.seconds})
        engine.engine.destroy()
        del engine

    # side by side on the same state dict and disk, interleaved and repeated (the disk is shared:
    # the median of --repeats rounds, each round running every method once)
    nbytes = publish_rows[-1]["bytes"]
    target = work / "cmp"
    target.mkdir(exist_ok=True)
    times: dict[str, list[float]] = {"raw": [], "torch": [], "safetensors": [], "tandem": []}
    for rep in range(args.repeats):
        times["raw"].append(raw_write(target / "raw.bin", nbytes))
        t0 = time.perf_counter()
        torch.save(state, target / "state.pt")
        fsync_path(target / "state.pt")
        times["torch"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        save_file(state, target / "st.safetensors")
        fsync_path(target / "st.safetensors")
        times["safetensors"].append(time.perf_counter() - t0)
        times["tandem"].append(store.write_version(target / "versions", rep + 1, state).seconds)
        for p in target.iterdir():
            if p.is_file():
                p.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    raw_s = med["raw"]

    gb = nbytes / 1e9
    print()
    print(f"publish vs disk, {nbytes / 1e6:.1f} MB of fp32 weights, median of {args.repeats} interleaved rounds, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, {work}")
    print(f"{'method':<46} {'seconds':>8} {'GB/s':>7} {'% raw':>6}")

    def line(name: str, s: float) -> None:
        print(f"{name:<46} {s:8.3f} {gb / s:7.2f} {100 * raw_s / s:5.0f}%")

    line("raw write (dd-style, 16 MiB chunks + fsync)", raw_s)
    line("torch.save + fsync", med["torch"])
    line("safetensors.save_file + fsync", med["safetensors"])
    line("tandem publish write (safetensors+sha256+atomic)", med["tandem"])
    print("per stage, once, as the learner publishes after training:")
    for r in publish_rows:
        line(f"  ZeRO-{r['stage']} gather + write", r["total_s"])
    print(f"\npublish write speed: {100 * raw_s / med['tandem']:.0f}% of raw (target >= 50%)")
    print(json.dumps({"params": params, "train": rows, "publish": publish_rows, "median_s": med, "bytes": nbytes}))


if __name__ == "__main__":
    main()
