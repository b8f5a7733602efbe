"""What a keep-mode reload's pause costs vLLM at the example's size, and whether keeping the KV cache would save it.

    .venv/bin/python bench/reload_kv.py MODE [--groups 384] [--at-once 17] [--period 0.7]

MODE ``none``: the example's groups (8 samples x 24 tokens, temperature 1) generate on the example's model,
``--at-once`` of them in the engine, as the rollout server runs vLLM (compiled, fp32); ``clear``: every
``--period`` seconds (about a learner step) a reload's pause in ``"keep"`` mode with the KV cache of the
frozen requests dropped and recomputed (``rollout_server.reload.pause``, what tandem does), a new weight-version
label, resume; ``kept``: the same pause keeping the KV cache (``clear_cache=False``, PipelineRL's choice). The
weights themselves are not changed: the figure is the pause and the recomputation. Run it with
``VLLM_CPU_OMP_THREADS_BIND=0`` to put vLLM on one core as the stack does. Prints samples/s, CPU-ms per
sample (the process tree) and the pauses' mean length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.generate_cpu import TOKENS, N, tree_cpu_s  # noqa: E402


async def run(model: str, mode: str, groups: int, at_once: int, period: float) -> dict:
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine, Sampling
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    engine = await RolloutEngine.start(model, RolloutSettings(kv_cache_gib=0.25, seed=0, max_num_seqs=512),
                                       metrics=RolloutMetrics(CollectorRegistry()), max_model_len=64,
                                       dtype="float32")
    llm = engine.llm
    try:
        _, ids = engine.prompt_ids("12+30=", None, {})
        sampling = Sampling(n=N, temperature=1.0, max_tokens=TOKENS, min_tokens=TOKENS)
        await asyncio.gather(*(engine.generate(ids, sampling) for _ in range(4)))  # warm
        room = asyncio.Semaphore(at_once)
        done, pauses, version = asyncio.Event(), [], 1

        async def group() -> None:
            async with room:
                await engine.generate(ids, sampling)

        async def reloads() -> None:
            nonlocal version
            while not done.is_set():
                await asyncio.sleep(period)
                if mode == "none" or done.is_set():
                    continue
                t = time.monotonic()
                await llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=mode == "clear")
                version += 1
                await llm.update_weight_version(str(version))
                await llm.resume_generation()
                pauses.append(time.monotonic() - t)

        reloader = asyncio.ensure_future(reloads())
        cpu0, t0 = tree_cpu_s(), time.monotonic()
        await asyncio.gather(*(group() for _ in range(groups)))
        wall, cpu = time.monotonic() - t0, tree_cpu_s() - cpu0
        done.set()
        await reloader
        return {"mode": mode, "at_once": at_once, "samples_per_s": round(groups * N / wall, 1),
                "cpu_ms": round(1000 * cpu / (groups * N), 3), "reloads": len(pauses),
                "pause_ms": round(1000 * sum(pauses) / max(len(pauses), 1), 2)}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("none", "clear", "kept"))
    ap.add_argument("--model", default=str(ROOT / "runs/models/arith"))
    ap.add_argument("--groups", type=int, default=384)
    ap.add_argument("--at-once", type=int, default=17, help="groups in the engine at once (the example: 17-18)")
    ap.add_argument("--period", type=float, default=0.7, help="seconds between reloads (about a learner step)")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"{args.model} holds no model: `make run` builds the example's")
    print(json.dumps(asyncio.run(run(args.model, args.mode, args.groups, args.at_once, args.period))))


if __name__ == "__main__":
    main()
