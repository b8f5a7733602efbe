"""LoRA versions as adapters against merged full weights: bytes per version, write and reload seconds.

    python bench/adapter.py                          # the tiny model and a 126M-parameter one
    python bench/adapter.py --sizes tiny --versions 2 --out /tmp/adapter.json

For each model (built in code, random weights, float32: ``examples.tiny.tiny_qwen3``) it makes
``--versions`` LoRA states at ``--rank`` (8) on q/k/v/o, the presets' targets (PEFT, each with its
own random ``lora_B`` so that no two versions are equal), and publishes each both ways with the
learner's writer (``services.weightstore.write_version``; the adapter in the layout
``learner.publisher.publish_tensors`` asks for, the merged weights from peft's ``merge_and_unload``).
Then, as a run would be served:

- **merged**: a plain vLLM engine (``RolloutEngine``) loads each full version in place;
- **adapter**: an engine started with LoRA (``lora_rank``, LoRA layers on the targets only, as a
  run's server starts) loads each as an adapter (``rollout_server.adapters``: add the new one,
  remove the previous one).

Both engines run at once and take turns (who goes first alternates), so the machine's load falls on
both alike. A reload is ``RolloutEngine.load_weights``, end to end: read and sha256 the version,
check it fits, pause vLLM, load, resume. After the reloads each engine generates the same batch
``--rounds`` times (4 prompts x 4 samples): the cost of serving through LoRA, per token. It prints
both formats side by side per model and writes the raw figures to ``--out``
(bench/results/adapter.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    "tiny": {},  # examples.tiny.tiny_qwen3's defaults: 2 layers, hidden 64
    "126M": dict(hidden=1024, layers=10, heads=16, kv_heads=8, head_dim=64, intermediate=3072),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPT_IDS = [[5 + i, 20 + i, 33, 40 + i] for i in range(4)]


def build_versions(model: Path, out: Path, rank: int, versions: int) -> tuple[int, int, list[dict]]:
    """(the model's parameters, the adapter's parameters, per version ``{"adapter": Written, "merged": Written}``)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from services import weightstore

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    params = sum(p.numel() for p in base.parameters())
    tied = bool(base.config.tie_word_embeddings)
    written = []
    for v in range(1, versions + 1):
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        gen = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        adapter = get_peft_model_state_dict(peft_model)
        config = peft_model.peft_config["default"].to_dict()
        config["base_model_name_or_path"] = str(model)
        config_text = json.dumps(config, default=lambda x: sorted(x) if isinstance(x, set) else str(x))
        merged = {k: t.contiguous() for k, t in peft_model.merge_and_unload().state_dict().items()
                  if not (tied and k == "lm_head.weight")}
        a = weightstore.write_version(out / "adapter", v, adapter, weights_name="adapter_model.safetensors",
                                      extra_files={"adapter_config.json": config_text})
        m = weightstore.write_version(out / "merged", v, merged)
        written.append({"adapter": a, "merged": m})
    return params, sum(t.numel() for t in adapter.values()), written


async def start(model: Path, lora_rank: int | None):
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    t0 = time.perf_counter()
    engine = await RolloutEngine.start(model, RolloutSettings(kv_cache_gib=0.5, enforce_eager=True, seed=0),
                                       metrics=RolloutMetrics(CollectorRegistry()), max_model_len=256,
                                       dtype="float32", lora_rank=lora_rank,
                                       lora_targets=TARGETS if lora_rank else None)  # as a run's server: its targets
    return engine, time.perf_counter() - t0


async def tokens_per_s(engine, max_tokens: int) -> float:
    from rollout_server.engine import Sampling

    t = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(ids, Sampling(n=4, max_tokens=max_tokens, seed=i))
                                  for i, ids in enumerate(PROMPT_IDS)))
    return sum(len(s.token_ids) for g in gens for s in g.samples) / (time.perf_counter() - t)


async def serve(model: Path, written: list[dict], rank: int, max_tokens: int, rounds: int) -> dict:
    """Both engines up at once (a plain one for merged versions, a LoRA one for adapters), taking turns:
    each loads each version, then each generates the same batch ``rounds`` times; the timings."""
    from services.wire import LoadWeights

    engines, out = {}, {}
    try:
        for kind, lora_rank in (("merged", None), ("adapter", rank)):
            engines[kind], start_s = await start(model, lora_rank)
            out[kind] = {"engine_start_s": start_s, "reload_s": [], "tokens_per_s": []}
            await tokens_per_s(engines[kind], max_tokens)  # warm-up
        order = list(engines)
        for i, w in enumerate(written):
            for kind in order[i % 2:] + order[:i % 2]:  # who goes first alternates
                version = w[kind]
                t = time.perf_counter()
                status = await engines[kind].load_weights(
                    LoadWeights(version=version.version, uri=str(version.path), sha256=version.sha256))
                out[kind]["reload_s"].append(time.perf_counter() - t)
                assert status.version == version.version
        for i in range(rounds):
            for kind in order[i % 2:] + order[:i % 2]:
                out[kind]["tokens_per_s"].append(await tokens_per_s(engines[kind], max_tokens))
        assert len(await engines["adapter"].llm.list_loras()) == 1, "the previous adapters were not removed"
    finally:
        for engine in engines.values():
            engine.shutdown()
    return out


def measure(size: str, rank: int, versions: int, max_tokens: int, rounds: int, workdir: Path) -> dict:
    from examples.tiny import tiny_qwen3

    model = tiny_qwen3(workdir / size / "model", seed=0, **SIZES[size])
    params, adapter_params, written = build_versions(model, workdir / size, rank, versions)
    served = asyncio.run(serve(model, written, rank, max_tokens, rounds))
    rows = {}
    for kind in ("merged", "adapter"):
        ws = [w[kind] for w in written]
        rows[kind] = {"bytes": statistics.median(w.bytes for w in ws),
                      "write_s": statistics.median(w.seconds for w in ws),
                      "reload_s_median": statistics.median(served[kind]["reload_s"]),
                      "tokens_per_s_median": statistics.median(served[kind]["tokens_per_s"]), **served[kind]}
    rows["bytes_ratio"] = rows["merged"]["bytes"] / rows["adapter"]["bytes"]
    rows["reload_ratio"] = rows["merged"]["reload_s_median"] / rows["adapter"]["reload_s_median"]
    return {"size": size, "parameters": params, "adapter_parameters": adapter_params, "rank": rank,
            "targets": TARGETS, **rows}


def show(r: dict) -> None:
    m, a = r["merged"], r["adapter"]
    print(f"\n{r['size']} model: {r['parameters'] / 1e6:.1f}M parameters, float32, LoRA rank {r['rank']} on "
          f"{'/'.join(t.split('_')[0] for t in r['targets'])}")
    print(f"  {'':28}{'merged':>14}{'adapter':>14}{'merged/adapter':>16}")
    print(f"  {'bytes per version':28}{m['bytes']:>14,.0f}{a['bytes']:>14,.0f}{r['bytes_ratio']:>15.1f}x")
    print(f"  {'write s (learner)':28}{m['write_s']:>14.4f}{a['write_s']:>14.4f}{m['write_s'] / a['write_s']:>15.1f}x")
    print(f"  {'reload s (rollout, median)':28}{m['reload_s_median']:>14.4f}{a['reload_s_median']:>14.4f}"
          f"{r['reload_ratio']:>15.1f}x")
    print(f"  {'engine start s':28}{m['engine_start_s']:>14.1f}{a['engine_start_s']:>14.1f}")
    print(f"  {'generation tokens/s (median)':28}{m['tokens_per_s_median']:>14.0f}{a['tokens_per_s_median']:>14.0f}"
          f"{m['tokens_per_s_median'] / a['tokens_per_s_median']:>15.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,126M", help=f"Comma-separated, of {', '.join(SIZES)}.")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--versions", type=int, default=3, help="Versions published and loaded per format.")
    ap.add_argument("--max-tokens", type=int, default=32, help="Per sample of the generation batch (4 prompts x 4).")
    ap.add_argument("--rounds", type=int, default=3, help="Generation batches per engine, the engines taking turns.")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "adapter.json")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="tandem-adapter-bench-") as tmp:
        for size in args.sizes.split(","):
            results.append(measure(size, args.rank, args.versions, args.max_tokens, args.rounds, Path(tmp)))
            show(results[-1])
    report = {"command": "python bench/adapter.py " + " ".join(sys.argv[1:]), "machine": platform.platform(),
              "cpus": os.cpu_count(), "created_at": time.time(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
