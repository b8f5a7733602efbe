"""What the trajectory ledger costs: the broker's path for a group with the ledger on and off, side by side.

    .venv/bin/python bench/ledger.py [--groups 4000] [--rounds 3]

One embedded redis-server (AOF on, as in production). Each group goes the
whole broker path a run takes: enqueued on the prompts stream (``queued``),
read by a rollout consumer (``admitted``), handed off to the trajectories
stream (``generated``), read by the learner (``handed``), acknowledged after
training (``trained``). *on* is the code as shipped; *off* is the same code
with the ledger's writes taken out (the scripts' ``ledger()`` made a no-op,
no Python-side appends). Payloads are small (the cost of the entries, not of
moving trajectories, is the question). Rounds alternate on/off; it prints
groups/s per variant (best round), the ratio, the ledger's Redis memory and
file size per group, and how long exporting and auditing the ledger take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from broker import Envelope, Keys, Stream, connect  # noqa: E402
from broker.embedded import EmbeddedRedis  # noqa: E402
from broker.ledger import LUA, Ledger, read_file  # noqa: E402
from deploy.audit import audit  # noqa: E402

NOOP = "\nlocal function ledger(key, event, gid, detail) end\n"
BATCH = 16


def _ledger_off(stream: Stream) -> None:
    for name in ("_ack", "_handoff", "_dead", "_close"):
        script = getattr(stream, name)
        setattr(stream, name, stream.redis.register_script(script.script.replace(LUA, NOOP)))


async def one_round(url: str, run: str, groups: int, on: bool) -> float:
    redis = connect(url)
    keys = Keys(run)
    prompts, traj = Stream.prompts(redis, keys), Stream.trajectories(redis, keys)
    ledger = Ledger(redis, keys)
    if not on:
        _ledger_off(prompts)
        _ledger_off(traj)
    await prompts.ensure_group()
    await traj.ensure_group()
    envelopes = [Envelope(f"g{i}", -1, b"p" * 64) for i in range(groups)]
    t0 = time.perf_counter()
    for i in range(0, groups, 500):
        chunk = envelopes[i:i + 500]
        if on:
            await prompts.add_many(chunk, details=[{"epoch": 0, "index": j} for j in range(i, i + len(chunk))])
        else:
            pipe = redis.pipeline(transaction=True)
            for e in chunk:
                pipe.xadd(prompts.key, {"g": e.group_id, "v": e.policy_version, "p": e.payload})
            await pipe.execute()
    done = 0
    while done < groups:
        got = await prompts.read("rollout", count=BATCH, block_ms=None)
        for d in got:
            if on:
                await ledger.append("admitted", d.envelope.group_id, server="bench", loaded_version=0, delivery=1)
            await prompts.handoff(d, traj, Envelope(d.envelope.group_id, 0, b"t" * 256), "",
                                  server="bench", version=0, statuses={"ok": 8}, reward_mean=0.5)
        learned = await traj.read("learner", count=BATCH, block_ms=None)
        if on:
            await ledger.append_many("handed", [(d.envelope.group_id, {"delivery": 1, "version": 0}) for d in learned])
        await traj.ack(learned, counter="accepted", event="trained" if on else "",
                       details={"step": 1, "basis": 0, "version": 0})
        done += len(learned)
    seconds = time.perf_counter() - t0
    await redis.aclose()
    return groups / seconds


async def main(groups: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ledger-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(rounds):
            for variant in ("off", "on") if r % 2 else ("on", "off"):
                rates[variant].append(await one_round(server.url, f"{variant}-{r}", groups, variant == "on"))
        redis = connect(server.url)
        keys = Keys(f"on-{rounds - 1}")
        memory = await redis.memory_usage(keys.ledger)
        entries = await redis.xlen(keys.ledger)
        t0 = time.perf_counter()
        path = Path(tmp) / "ledger.jsonl"
        await Ledger(redis, keys).export(path)
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        verdict = audit(read_file(path))
        audit_s = time.perf_counter() - t0
        file_bytes = path.stat().st_size
        await redis.aclose()
    best = {k: max(v) for k, v in rates.items()}
    return {"groups": groups, "rounds": rounds, "groups_per_s": best, "all_rounds": rates,
            "ratio_on_off": round(best["on"] / best["off"], 3), "entries_per_group": entries / groups,
            "redis_bytes_per_group": round(memory / groups, 1), "file_bytes_per_group": round(file_bytes / groups, 1),
            "export_s": round(export_s, 3), "audit_s": round(audit_s, 3), "audit_ok_before_close": verdict.ok}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("command:", " ".join(sys.argv))
    out = asyncio.run(main(args.groups, args.rounds))
    print(f"{'variant':8} {'groups/s (best of ' + str(args.rounds) + ')':>24}")
    for k in ("off", "on"):
        print(f"{k:8} {out['groups_per_s'][k]:>24.0f}")
    print(f"ledger on / off: {out['ratio_on_off']:.2f}; {out['entries_per_group']:.0f} entries, "
          f"{out['redis_bytes_per_group']:.0f} B in Redis, {out['file_bytes_per_group']:.0f} B on file per group; "
          f"export {out['export_s']:.2f} s, audit {out['audit_s']:.2f} s for {args.groups} groups")
    results = Path(__file__).resolve().parent / "results" / "ledger.json"
    results.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {results}")
