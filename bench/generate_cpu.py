"""CPU per generated sample at the example's size: tandem's rollout engine (vLLM) against Hugging Face generate.

    .venv/bin/python bench/generate_cpu.py [--model runs/models/arith] [--groups 192]

The example's job (docs/performance.md, "tandem against TRL"): 8 samples of 24 tokens per prompt,
temperature 1, on the example's 0.8M-parameter policy. Each side is a process of its own:

- vLLM, as the rollout server runs it (``RolloutEngine``: fp32, eager, sampled-token log-probs, its
  engine core and worker): ``--groups`` groups, 16 and then 64 generating at once, CPU-seconds of the
  process tree (the engine core and the worker included); then the same with ``enforce_eager=False``
  (vLLM's torch.compile of the model on CPU);
- Hugging Face ``generate`` (TRL's generation without vLLM): 16 prompts x 8 in one batch, as one
  TRL step generates them, on 1 and then 2 torch threads.

It prints CPU-milliseconds per generated sample side by side. At this size a step's model compute is
tiny, so the figure is each engine's cost per step and per sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host.cpu import descendants, read_stat  # noqa: E402

N, TOKENS, PROMPTS = 8, 24, 16


def tree_cpu_s() -> float:
    return sum(stat[2] for pid in descendants([os.getpid()]) if (stat := read_stat(pid)) is not None)


async def vllm_side(model: str, groups: int, eager: bool) -> list[dict]:
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine, Sampling
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    engine = await RolloutEngine.start(model, RolloutSettings(kv_cache_gib=0.25, seed=0, max_num_seqs=512,
                                                                      enforce_eager=eager),
                                       metrics=RolloutMetrics(CollectorRegistry()), max_model_len=64,
                                       dtype="float32")
    try:
        _, ids = engine.prompt_ids("12+30=", None, {})
        sampling = Sampling(n=N, temperature=1.0, max_tokens=TOKENS, min_tokens=TOKENS)
        await asyncio.gather(*(engine.generate(ids, sampling) for _ in range(4)))  # warm
        rows = []
        for at_once in (16, 64):
            room = asyncio.Semaphore(at_once)

            async def group(room: asyncio.Semaphore = room) -> None:
                async with room:
                    await engine.generate(ids, sampling)

            cpu0, t0 = tree_cpu_s(), time.monotonic()
            await asyncio.gather(*(group() for _ in range(groups)))
            wall, cpu = time.monotonic() - t0, tree_cpu_s() - cpu0
            rows.append({"side": f"vLLM (RolloutEngine{'' if eager else ', compiled'}), {at_once} groups at once",
                         "cpu_ms": 1000 * cpu / (groups * N), "samples_per_s": groups * N / wall})
        return rows
    finally:
        engine.shutdown()


def hf_side(model: str, threads: int, rounds: int = 10) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    batch = tok([f"{a}+{b}=" for a, b in zip(range(10, 10 + PROMPTS), range(30, 30 + PROMPTS), strict=True)],
                return_tensors="pt", padding=True)
    kwargs = dict(input_ids=batch["input_ids"].repeat_interleave(N, 0),
                  attention_mask=batch["attention_mask"].repeat_interleave(N, 0), do_sample=True,
                  temperature=1.0, max_new_tokens=TOKENS, min_new_tokens=TOKENS, pad_token_id=tok.pad_token_id)

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    with torch.no_grad():
        policy.generate(**kwargs)  # warm
        cpu0, t0 = cpu_s(), time.monotonic()
        for _ in range(rounds):
            policy.generate(**kwargs)
        wall, cpu = time.monotonic() - t0, cpu_s() - cpu0
    samples = rounds * PROMPTS * N
    return {"side": f"Hugging Face generate, {PROMPTS * N} sequences, {threads} thread(s)",
            "cpu_ms": 1000 * cpu / samples, "samples_per_s": samples / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "runs/models/arith"))
    ap.add_argument("--groups", type=int, default=192)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a side's own process: "vllm" or a thread count
    args = ap.parse_args()
    if args.one is not None:
        rows = asyncio.run(vllm_side(args.model, args.groups, args.one == "vllm")) if args.one.startswith(
            "vllm") else [hf_side(args.model, int(args.one))]
        print(json.dumps(rows))
        return
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"{args.model} holds no model: `make run` builds the example's")
    print(f"{N} samples x {TOKENS} tokens per prompt, temperature 1, {args.model}\n")
    print("| engine | CPU-ms per generated sample | samples/s |\n|---|---:|---:|")
    for one in ("vllm", "vllm-compiled", "1", "2"):
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--groups", str(args.groups),
                               "--one", one], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            print(f"| {row['side']} | {row['cpu_ms']:.2f} | {row['samples_per_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
