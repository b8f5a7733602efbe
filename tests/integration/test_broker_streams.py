"""Streams against a real Redis: delivery, redelivery, dead letters, idempotency, backpressure."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from broker import Envelope, QueueFull, Stream
from services import wire


def _traj(group_id: str, version: int = 0) -> bytes:
    s = wire.ScoredSample(token_ids=[1, 2], logprobs=[-0.5, -0.1], text="ab", finish_reason="stop",
                          policy_version=version, reward=1.0, status="ok")
    return wire.encode(wire.TrajectoryGroup(run_id="r", group_id=group_id, prompt="p", prompt_token_ids=[3],
                                            samples=[s], n=1, policy_version=version))


async def _counters(redis, keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}


async def test_consumer_killed_between_read_and_ack_is_redelivered_and_trained_once(redis, redis_url, keys):
    stream = Stream.trajectories(redis, keys, visibility_timeout_s=0.5)
    await stream.ensure_group()
    ids = [f"g{i}" for i in range(5)]
    for gid in ids:
        await stream.add(Envelope(gid, 0, _traj(gid)))

    # A real consumer process reads everything, then is killed -9 before acking.
    script = textwrap.dedent(f"""
        import asyncio, sys, time
        from broker import Keys, Stream, connect
        async def main():
            r = connect({redis_url!r})
            s = Stream.trajectories(r, Keys({keys.run_id!r}), visibility_timeout_s=0.5)
            before = time.monotonic()
            got = await s.read("doomed", count=10, block_ms=2000)
            print(len(got), before, flush=True)
            await asyncio.sleep(3600)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        count, read_before = proc.stdout.readline().split()
        assert count == "5"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # Wait for the redelivery itself (a loaded machine may be late, never early): nothing comes back
    # until the 0.5 s visibility timeout has passed since the doomed read (CLOCK_MONOTONIC is system-wide).
    trained = []
    deadline = time.monotonic() + 30
    while len(trained) < len(ids):
        assert time.monotonic() < deadline, f"only {trained} came back"
        batch = await stream.read("survivor", count=10, block_ms=None)
        if not batch:
            await asyncio.sleep(0.05)
            continue
        assert time.monotonic() - float(read_before) >= 0.5, "redelivered within the visibility timeout"
        trained += [d.envelope.group_id for d in batch]
        assert all(d.deliveries == 2 for d in batch)
        await stream.ack(batch, counter="accepted")
    assert sorted(trained) == ids
    assert await stream.backlog() == 0 and await stream.pending() == 0
    c = await _counters(redis, keys)
    assert c["redelivered"] == 5 and c["accepted"] == 5


async def test_same_group_id_twice_is_processed_once(redis, keys):
    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    await stream.add(Envelope("g1", 0, _traj("g1")))
    await stream.add(Envelope("g1", 0, _traj("g1")))  # a producer that retried
    first = await stream.read("c", count=10, block_ms=None)
    assert [d.envelope.group_id for d in first] == ["g1"]
    await stream.ack(first)
    await stream.add(Envelope("g1", 0, _traj("g1")))  # redelivered after it was done
    assert await stream.read("c", count=10, block_ms=None) == []
    assert (await _counters(redis, keys))["duplicates"] == 2
    assert await stream.backlog() == 0


async def test_entry_over_delivery_limit_is_dead_lettered(redis, keys):
    stream = Stream.trajectories(redis, keys, visibility_timeout_s=0.05, max_deliveries=2)
    await stream.ensure_group()
    await stream.add(Envelope("poison", 0, _traj("poison")))
    deliveries = []
    for _ in range(4):
        deliveries += [d.deliveries for d in await stream.read("c", count=1, block_ms=None)]
        await asyncio.sleep(0.1)
    assert deliveries == [1, 2]
    dead = await stream.dead_letters()
    assert dead[0]["g"] == "poison" and "delivered 3 times" in dead[0]["reason"]
    assert await stream.backlog() == 0


async def test_malformed_entries_are_dead_lettered_and_the_consumer_goes_on(redis, keys):
    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    await redis.xadd(keys.trajectories, {"junk": "no envelope"})
    await redis.xadd(keys.trajectories, {"g": "v-not-int", "v": "x", "p": b""})
    await stream.add(Envelope("bad-schema", 0, b"\x93\x01\x02\x03"))
    await stream.add(Envelope("wrong-fields", 0, wire.encode(wire.PromptGroup(
        run_id="r", group_id="x", prompt="p", spec=wire.ExactSpec(answer="1"), n=1))))
    await stream.add(Envelope("good", 0, _traj("good")))

    good = []
    for d in await stream.read("c", count=10, block_ms=None):
        group = await wire.decode_delivery(stream, d, wire.TrajectoryGroup)
        if group is not None:
            good.append(group.group_id)
            await stream.ack([d])
    assert good == ["good"]
    reasons = [x["reason"] for x in await stream.dead_letters()]
    assert len(reasons) == 4
    assert sum("malformed envelope" in r for r in reasons) == 2
    assert sum("invalid TrajectoryGroup" in r for r in reasons) == 2
    assert (await _counters(redis, keys))["dead_lettered"] == 4
    assert await stream.backlog() == 0


async def test_bounded_stream_signals_backpressure_and_loses_nothing(redis, keys):
    stream = Stream(redis, keys, keys.prompts, "rollout", maxlen=3)
    await stream.ensure_group()
    for i in range(3):
        await stream.add(Envelope(f"p{i}", -1, b"x"))
    with pytest.raises(QueueFull, match="holds 3 entries"):
        await stream.add(Envelope("p3", -1, b"x"))

    async def consume_one_later():
        await asyncio.sleep(0.2)
        await stream.ack(await stream.read("c", count=1, block_ms=None))

    consumer = asyncio.create_task(consume_one_later())
    await stream.add(Envelope("p3", -1, b"x"), wait_s=5)  # waits for room instead of dropping
    await consumer
    rest = await stream.read("c", count=10, block_ms=None)
    assert [d.envelope.group_id for d in rest] == ["p1", "p2", "p3"]
