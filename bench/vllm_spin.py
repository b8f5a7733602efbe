"""vLLM's wait loop against a learner on the same cores: ``rollout.vllm_spin_s`` capped or vLLM's own.

    .venv/bin/python bench/vllm_spin.py [--model runs/models/arith] [--rounds 2] [--waves 10]

Each measurement is a process of its own: it starts the rollout engine (the example's model, as
``tandem run`` serves it) with the setting, then generates 160 groups of 8 x 24 tokens, 8 groups
at a time, in ``--waves`` waves with 0.5 s between them (the gaps a rollout server idles in while
the learner steps), beside a process that only burns CPU (the learner's stand-in). It prints the
groups per second, the burner's work per second (what the learner would get) and the CPU-seconds the
engine's processes and the burner used. The settings alternate, ``--rounds`` times each: this
machine is noisy, so compare within a round. docs/performance.md, "Where the CPU goes", quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host.cpu import descendants, read_stat  # noqa: E402

SETTINGS = {"vLLM's own (1 s)": None, "capped (0.05 s, the default)": 0.05}
GROUPS, AT_ONCE = 160, 8


def burn(out, stop) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(100_000):
            n += 1
    out.put(n)


def tree_cpu_s() -> float:
    return sum(stat[2] for pid in descendants([os.getpid()]) if (stat := read_stat(pid)) is not None)


async def measure(model: str, spin_s: float | None, waves: int) -> dict:
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine, Sampling
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    settings = RolloutSettings(kv_cache_gib=0.25, enforce_eager=True, seed=0, vllm_spin_s=spin_s)
    engine = await RolloutEngine.start(model, settings, metrics=RolloutMetrics(CollectorRegistry()),
                                       max_model_len=64, dtype="float32")
    try:
        _, ids = engine.prompt_ids("What is 12 + 30? Answer:", None, {})
        sampling = Sampling(n=8, temperature=1.0, max_tokens=24, min_tokens=24)
        await asyncio.gather(*(engine.generate(ids, sampling) for _ in range(4)))  # warm
        ctx = mp.get_context("fork")
        out, stop = ctx.Queue(), ctx.Event()
        burner = ctx.Process(target=burn, args=(out, stop))
        burner.start()
        cpu0, t0 = tree_cpu_s(), time.monotonic()
        room = asyncio.Semaphore(AT_ONCE)

        async def group() -> None:
            async with room:
                await engine.generate(ids, sampling)

        for wave in range(waves):
            await asyncio.gather(*(group() for _ in range(GROUPS // waves)))
            if wave < waves - 1:
                await asyncio.sleep(0.5)
        wall = time.monotonic() - t0
        cpu = tree_cpu_s() - cpu0  # the engine's processes and the burner, still alive
        stop.set()
        work = out.get()
        burner.join()
    finally:
        engine.shutdown()
    return {"groups_per_s": GROUPS / wall, "burner_m_per_s": work / wall / 1e6, "cpu_s": cpu, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "runs/models/arith"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waves", type=int, default=10)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a measurement's own process: the setting as JSON
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(asyncio.run(measure(args.model, json.loads(args.one), args.waves))))
        return
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"{args.model} holds no model: `make run` builds the example's")
    print(f"{GROUPS} groups of 8 x 24 tokens, {AT_ONCE} at a time, {args.waves} waves 0.5 s apart, beside a CPU burner\n")
    print("| round | vLLM's wait loop | groups/s | burner Mops/s | CPU-s (engine + burner) |\n|---|---|---:|---:|---:|")
    for r in range(1, args.rounds + 1):
        for name, spin_s in SETTINGS.items():
            done = subprocess.run([sys.executable, __file__, "--model", args.model, "--waves", str(args.waves),
                                   "--one", json.dumps(spin_s)], capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(done.stderr[-3000:])
            m = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {r} | {name} | {m['groups_per_s']:.2f} | {m['burner_m_per_s']:.1f} | {m['cpu_s']:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
