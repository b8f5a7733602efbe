"""Broker throughput: tandem's produce -> consume -> ack path vs raw Redis XADD.

    .venv/bin/python bench/broker.py [--groups 4000] [--producers 2] [--consumers 2]

One embedded redis-server (AOF on, as in production) serves both sides of
the comparison in the same run:

- raw:    ``redis-benchmark`` XADD of payloads of exactly the size of one
          encoded trajectory group, with as many clients as tandem uses
          connections (producers + consumers), and with its default 50;
- tandem: producer processes build and encode realistic trajectory groups
          (G = 8 completions of 512 tokens, token ids + behaviour log-probs)
          and add them to the trajectories stream, ``--inflight`` at a time
          each (the actor hands off many groups concurrently); consumer processes read
          them through the consumer group, decode and validate them, and
          ack them (idempotency set, ticket release) in batches.

It prints groups/s and MB/s side by side and the ratio to the raw rate.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This file is named like the package it measures: drop its own folder from
# the import path so `import broker` finds the package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from broker import Envelope, Keys, Stream, connect  # noqa: E402
from broker.embedded import EmbeddedRedis  # noqa: E402
from services import wire  # noqa: E402

RUN = "bench"


def make_group(group_id: str, rng: random.Random, g: int, tokens: int) -> wire.TrajectoryGroup:
    samples = [
        wire.ScoredSample(
            token_ids=[rng.randrange(151_000) for _ in range(tokens)],
            logprobs=[-rng.random() * 4 for _ in range(tokens)],
            text="".join(rng.choice("abcdefgh ") for _ in range(tokens * 3)),
            finish_reason="length", policy_version=7, reward=float(rng.random() < 0.5), status="ok",
        )
        for _ in range(g)
    ]
    return wire.TrajectoryGroup(
        run_id=RUN, group_id=group_id, prompt="Solve: " + "x" * 200, prompt_token_ids=list(range(64)),
        samples=samples, n=g, policy_version=7,
    )


def _producer(url: str, worker: int, count: int, g: int, tokens: int, inflight: int, start: mp.Event,
              cpu: mp.Value) -> None:
    async def main():
        rng = random.Random(worker)
        template = make_group("t", rng, g, tokens)
        redis = connect(url)
        stream = Stream.trajectories(redis, Keys(RUN))

        async def lane(lane_no: int):  # like one of the actor's concurrent groups
            for i in range(lane_no, count, inflight):
                group = template.model_copy(update={"group_id": f"p{worker}-{i}"})
                await stream.add(Envelope(group.group_id, group.policy_version, wire.encode(group)))

        start.wait()
        t0 = time.process_time()
        await asyncio.gather(*(lane(k) for k in range(inflight)))
        with cpu.get_lock():
            cpu.value += time.process_time() - t0
        await redis.aclose()

    asyncio.run(main())


def _consumer(url: str, worker: int, total: int, start: mp.Event, done: mp.Value, cpu: mp.Value) -> None:
    async def main():
        redis = connect(url)
        keys = Keys(RUN)
        stream = Stream.trajectories(redis, keys)
        start.wait()
        t0 = time.process_time()
        while True:
            batch = await stream.read(f"c{worker}", count=32, block_ms=100)
            good = [d for d in batch if await wire.decode_delivery(stream, d, wire.TrajectoryGroup)]
            await stream.ack(good, counter="accepted")
            if int(await redis.hget(keys.counters, "accepted") or 0) >= total:
                break
        with done.get_lock():
            done.value = time.perf_counter()
        with cpu.get_lock():
            cpu.value += time.process_time() - t0
        await redis.aclose()

    asyncio.run(main())


def raw_xadd(port: int, password: str, size: int, n: int, clients: int) -> float:
    """redis-benchmark XADD rate (requests/s) with ``size``-byte payloads.

    redis-benchmark substitutes no data into a custom command, so the payload
    is passed literally (Linux caps one argument at 128 KiB).
    """
    if size > 131_000:
        raise SystemExit(f"payload of {size} bytes is over the 128 KiB argument limit of redis-benchmark")
    payload = "".join(random.Random(size).choice("abcdefghijklmnop") for _ in range(size))
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-a", password, "-n", str(n), "-c", str(clients),
         "-q", "XADD", "bench:raw", "*", "p", payload],
        capture_output=True, text=True, check=True,
    ).stdout
    rate = float(re.findall(r"([0-9.]+) requests per second", out)[-1])
    return rate


async def check_raw_payload(url: str, size: int) -> None:
    redis = connect(url)
    [(_id, fields)] = await redis.xrange("bench:raw", count=1)
    assert len(fields[b"p"]) == size, (len(fields[b"p"]), size)
    await redis.delete("bench:raw")
    await redis.aclose()


async def setup(url: str) -> None:
    redis = connect(url)
    await Stream.trajectories(redis, Keys(RUN)).ensure_group()
    await redis.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=8,
                    help="concurrent adds per producer (the actor hands off up to actor_concurrency groups at once)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    if not shutil.which("redis-benchmark"):
        raise SystemExit("redis-benchmark not found (Debian package redis-tools)")

    size = len(wire.encode(make_group("p0-0", random.Random(0), args.group_size, args.tokens)))
    t0 = time.perf_counter()
    sample = make_group("x", random.Random(1), args.group_size, args.tokens)
    data = wire.encode(sample)
    enc_us = (time.perf_counter() - t0) * 1e6
    t0 = time.perf_counter()
    for _ in range(50):
        wire.decode(wire.TrajectoryGroup, data)
    dec_us = (time.perf_counter() - t0) / 50 * 1e6
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        asyncio.run(setup(server.url))
        conns = args.producers + args.consumers
        raw_same = raw_xadd(server.port, server.password, size, args.groups, conns)
        asyncio.run(check_raw_payload(server.url, size))
        raw_50 = raw_xadd(server.port, server.password, size, args.groups, 50)
        asyncio.run(check_raw_payload(server.url, size))

        ctx = mp.get_context("spawn")
        start, done = ctx.Event(), ctx.Value("d", 0.0)
        prod_cpu, cons_cpu = ctx.Value("d", 0.0), ctx.Value("d", 0.0)
        per = args.groups // args.producers
        total = per * args.producers
        procs = [ctx.Process(target=_producer, args=(server.url, w, per, args.group_size, args.tokens, args.inflight, start, prod_cpu))
                 for w in range(args.producers)]
        procs += [ctx.Process(target=_consumer, args=(server.url, w, total, start, done, cons_cpu))
                  for w in range(args.consumers)]
        for p in procs:
            p.start()
        time.sleep(3.0)  # let every process import and connect before the clock starts
        redis_cpu0 = _cpu_seconds(server.proc.pid)
        began = time.perf_counter()
        start.set()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"bench worker {p.name} failed with exit code {p.exitcode}")
        tandem = total / (done.value - began)
        redis_ms = (_cpu_seconds(server.proc.pid) - redis_cpu0) / total * 1e3

    mb = size / 1e6
    print(f"payload: one trajectory group = G {args.group_size} x {args.tokens} tokens = {size} bytes encoded")
    print(f"         encode {enc_us / 1000:.2f} ms (incl. building), decode+validate {dec_us / 1000:.2f} ms per group")
    print(f"{'path':<58} {'groups/s':>10} {'MB/s':>8} {'vs raw':>7}")
    rows = [
        (f"raw redis-benchmark XADD, {conns} clients", raw_same),
        ("raw redis-benchmark XADD, 50 clients", raw_50),
        (f"tandem add->read->decode->ack, {args.producers} prod + {args.consumers} cons", tandem),
    ]
    for name, rate in rows:
        print(f"{name:<58} {rate:>10.0f} {rate * mb:>8.1f} {rate / raw_same:>7.0%}")
    print(f"tandem / raw XADD ({conns} clients): {tandem / raw_same:.0%}   (target >= 50%)")
    prod_ms, cons_ms = prod_cpu.value / total * 1e3, cons_cpu.value / total * 1e3
    print(f"CPU per group on the tandem path: producers {prod_ms:.2f} ms (encode + add), consumers {cons_ms:.2f} ms "
          f"(read + decode/validate + ack), redis-server {redis_ms:.2f} ms; "
          f"{os.cpu_count()} cores -> at most {os.cpu_count() / (prod_ms + cons_ms + redis_ms) * 1e3:.0f} groups/s")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
