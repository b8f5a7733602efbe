"""The learner's step against what publishing a version blocks it for, files and broadcast side by side.

    DS_ACCELERATOR=cpu .venv/bin/python bench/publish_step.py --out bench/results/publish-step.json

Issue 24's target: "the learner blocked <= 10% of its step time by publishing at >= 100M parameters" with
``publish.transport = "broadcast"``. On a Qwen3-architecture model built in code (default 106M parameters:
hidden 1024, 9 layers, 16 query / 8 KV heads of 64, MLP 2816, character vocabulary; published in bf16), with
the learner's own code on CPU (``LearnerEngine`` under DeepSpeed, ZeRO-2 as the learner runs it by default,
fp32 training, gloo), one run times, for each transport, ``--rounds`` rounds of:

1. one ``LearnerEngine.train_step`` on one GRPO group (``--group-size`` 8 samples of ``--prompt-len`` +
   ``--completion-len`` = 64 tokens by default): the step's seconds;
2. the publish as ``learner.publisher.Publisher.publish`` does it, the learner's blocked seconds (its critical
   path) split into parts:

   - ``files``: the gather (``publisher.publish_tensors``) and ``services.weightstore.write_version``
     (safetensors, sha256, fsync, rename) on the learner's path;
   - ``broadcast``: the wait for the previous version's background write (the publisher's ``written``,
     before the gather that may refill the host buffers it reads), the gather,
     ``learner.publisher.Broadcaster.send`` to one member process (a rollout server's stand-in:
     it joins the run's board in Redis, waits for its seat and receives with ``services.weightgroup``, the
     code a vLLM worker runs, digest checked) and the copy the publisher makes of unsharded tensors; the files
     are then written in a background thread (as the publisher's ``_write``), so the next round's step runs
     while they are written (its step seconds include that contention).

A private ``redis-server`` (on a free port, no persistence) carries the board. The figures go to ``--out``
(JSON) and stdout: per transport, median step seconds, median blocked seconds and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.embedded import EmbeddedRedis  # noqa: E402

MODEL = dict(hidden=1024, layers=9, heads=16, kv_heads=8, head_dim=64, intermediate=2816)
TINY = dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=192)
"""``--tiny``: a check of the code in seconds (no target)."""

MEMBER = """
import asyncio, sys, time
from broker import Keys, connect
from broker.broadcast import BroadcastBoard
from services.weightgroup import WeightGroup, broadcast_key

async def main(url, run_id, name, count):
    redis = connect(url)
    board, last = BroadcastBoard(redis, Keys(run_id)), 0
    for _ in range(count):
        await board.join(name, 1)  # one vLLM worker's rank, as a rollout server's actor joins
        while (a := await board.wait_seat(name, last, timeout_s=5.0)) is None:
            await board.join(name, 1)
        t0 = time.perf_counter()
        group = WeightGroup(a.host, a.port, a.seats[name], a.world, key=broadcast_key(None), timeout_s=a.timeout_s,
                            name=a.group)
        _, digest = await asyncio.to_thread(group.receive)
        print(a.version, round(time.perf_counter() - t0, 4), digest, flush=True)
        last = a.version
    await redis.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def run(args, work: Path, redis_url: str) -> dict:
    import torch

    from bench.gpu import synthetic_groups
    from broker import Keys, connect
    from broker.broadcast import BroadcastBoard
    from examples.tiny import parameter_count, tiny_qwen3
    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from learner.publisher import Broadcaster, publish_tensors
    from services import weightstore as store
    from services.config import RunConfig
    from services.weightgroup import broadcast_key

    size = TINY if args.tiny else MODEL
    model = tiny_qwen3(work / "model", **size, max_positions=512, dtype="bfloat16", tie_embeddings=False)
    params = parameter_count(model)
    assert args.tiny or params >= 100e6, f"the model has {params / 1e6:.1f}M parameters, the target is about >= 100M"
    cfg = RunConfig.model_validate({
        "name": "publish-step", "model": {"path": str(model), "max_model_len": 512, "dtype": "bfloat16"},
        "data": {"train": "unused.jsonl"},
        "sampling": {"group_size": args.group_size, "max_tokens": args.completion_len},
        "learner": {"zero_stage": args.zero_stage, "lr": 1e-5, "micro_batch_tokens": 4096},
        "publish": {"transport": "broadcast", "broadcast_timeout_s": 60},
    })
    engine = LearnerEngine(cfg)
    dtype = getattr(torch, cfg.model.dtype)
    redis, keys = connect(redis_url), Keys("publish-step")
    root = str(Path(__file__).resolve().parents[1])
    member = subprocess.Popen([sys.executable, "-c", MEMBER, redis_url, keys.run_id, "rollout-0", str(args.rounds)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    board = BroadcastBoard(redis, keys)
    broadcaster = Broadcaster(redis, keys, cfg.publish, "127.0.0.1", broadcast_key(None))  # auth off here
    seqs = [build_batch(synthetic_groups(engine.vocab_size, 1, args.group_size, args.prompt_len,
                                         args.completion_len, seed=s), cfg.loss, cfg.sampling.max_tokens)
            for s in range(2 * args.rounds + 1)]
    tokens = sum(s.length for s in seqs[0])
    t = time.perf_counter()
    engine.train_step(seqs[0])  # warm-up
    warmup_s = time.perf_counter() - t
    rows: dict[str, list[dict]] = {"files": [], "broadcast": []}
    loads: list[list[float]] = [load_average()]
    writing: asyncio.Task | None = None
    version = 0
    try:
        while not await board.members():
            await asyncio.sleep(0.1)
        for transport in ("files", "broadcast"):
            for _ in range(args.rounds):
                version += 1
                t = time.perf_counter()
                engine.train_step(seqs[version])
                step_s = time.perf_counter() - t
                row = {"version": version, "step_s": step_s, "write_in_flight": writing is not None and not writing.done()}
                t0 = time.perf_counter()
                if transport == "broadcast":  # the publisher's written(), before the gather that may refill its buffers
                    if writing is not None:
                        await writing
                    row["wait_write_s"] = time.perf_counter() - t0
                t = time.perf_counter()
                tensors, _ = publish_tensors(engine, cfg, dtype)
                row["gather_s"] = time.perf_counter() - t
                if transport == "files":
                    written = store.write_version(work / "weights", version, tensors, step=version, replace=True)
                    row["write_s"] = written.seconds
                else:
                    t = time.perf_counter()
                    sent = await broadcaster.send(version, tensors)
                    assert sent is not None and sent.error is None, sent
                    row["send_s"] = time.perf_counter() - t
                    t = time.perf_counter()
                    if engine.zero_stage != 3:
                        tensors = {k: v.clone() for k, v in tensors.items()}
                    row["clone_s"] = time.perf_counter() - t
                    writing = asyncio.create_task(asyncio.to_thread(
                        store.write_version, work / "weights", version, tensors, step=version, replace=True))
                    await asyncio.sleep(0)  # its thread starts (the trainer awaits its report and next batch first)
                row["blocked_s"] = time.perf_counter() - t0
                row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                rows[transport].append(row)
                loads.append(load_average())
                print(transport, json.dumps(row), flush=True)
        if writing is not None:
            written = await writing
            rows["broadcast"][-1]["background_write_s"] = round(written.seconds, 4)
        received = member.communicate(timeout=300)[0].split("\n")
    finally:
        if member.poll() is None:
            member.kill()
            member.wait()
        await redis.aclose()
        engine.engine.destroy()
    summary = {}
    for transport, rs in rows.items():
        step, blocked = statistics.median(r["step_s"] for r in rs), statistics.median(r["blocked_s"] for r in rs)
        summary[transport] = {"step_s": round(step, 3), "blocked_s": round(blocked, 3),
                              "blocked_frac": round(blocked / step, 4),
                              "parts_s": {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]
                                          if k.endswith("_s") and k not in ("step_s", "blocked_s")}}
    return {"parameters": params, "model": size, "bytes_per_version": written.bytes,
            "batch": {"groups": 1, "group_size": args.group_size, "prompt_len": args.prompt_len,
                      "completion_len": args.completion_len, "tokens": tokens},
            "learner": {"zero_stage": engine.zero_stage, "precision": cfg.learner.precision, "backend": "gloo",
                        "torch_threads": torch.get_num_threads()},
            "warmup_step_s": round(warmup_s, 3), "rounds": rows, "summary": summary,
            "member": [line for line in received if line], "load_average": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="Steps + publishes per transport.")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=32)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="A tiny model: a check of the code, not a measurement.")
    ap.add_argument("--workdir", type=Path, default=None, help="Where the model and versions go (default: a temp dir).")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-publish-", dir=args.workdir) as tmp:
        with EmbeddedRedis(Path(tmp) / "redis") as redis:
            report = asyncio.run(run(args, Path(tmp), redis.url))
    import torch

    report = {"hardware": {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count()},
              **report, "wall_s": round(time.perf_counter() - started, 1)}
    print(f"{report['parameters'] / 1e6:.1f}M parameters, {report['bytes_per_version'] / 1e6:.0f} MB per version, "
          f"batch {report['batch']['tokens']} tokens; load average {report['load_average'][0]} -> "
          f"{report['load_average'][-1]}")
    print(f"{'transport':10} {'step s':>8} {'blocked s':>10} {'blocked/step':>13}  parts (median s)")
    for transport, s in report["summary"].items():
        print(f"{transport:10} {s['step_s']:>8.2f} {s['blocked_s']:>10.2f} {s['blocked_frac']:>13.1%}  {s['parts_s']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
