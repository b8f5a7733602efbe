"""Streams against a real Redis: delivery, redelivery, dead letters, idempotency, backpressure."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from broker import Envelope, QueueFull, Stream
from services import wire
from services.reward_specs import ExactSpec


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
        run_id="r", group_id="x", prompt="p", spec=ExactSpec(answer="1"), n=1))))
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


# -- edges that bench/mutation.py found untested (each test names what it guards) -----------------


async def test_connect_bounds_the_pool_only_when_asked(redis_url):
    from redis.asyncio import BlockingConnectionPool

    from broker import connect

    bounded = connect(redis_url, max_connections=2)
    plain = connect(redis_url)
    try:
        assert isinstance(bounded.connection_pool, BlockingConnectionPool)
        assert (bounded.connection_pool.max_connections, bounded.connection_pool.timeout) == (2, 5.0)
        assert not isinstance(plain.connection_pool, BlockingConnectionPool)
        assert await bounded.ping() and await plain.ping()
        kwargs = plain.connection_pool.connection_kwargs
        assert kwargs["health_check_interval"] == 30 and kwargs["decode_responses"] is False
        retry = plain.get_retry()  # 30 attempts, back-off 0.05 s doubling to 1 s: about 25 s in all
        assert retry.get_retries() == 30
        assert [retry._backoff.compute(n) for n in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    finally:
        await bounded.aclose()
        await plain.aclose()


async def test_a_dropped_connection_is_retried_and_a_wrong_password_is_not(redis, redis_url):
    from redis.exceptions import AuthenticationError

    from broker import connect

    client = connect(redis_url)
    try:
        assert await client.set("mutants:k", b"v")
        await redis.client_kill_filter(_id=await client.client_id())  # the server drops its connection
        assert await client.get("mutants:k") == b"v"  # reconnected and retried, not an error
    finally:
        await client.aclose()
    scheme, rest = redis_url.split("://", 1)
    wrong = connect(f"{scheme}://:not-the-password@{rest.rsplit('@', 1)[-1]}")
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            await wrong.ping()
    finally:
        await wrong.aclose()
    assert time.monotonic() - t0 < 10  # at once; 30 reconnect attempts with back-off take about 25 s


async def test_envelopes_and_deliveries_are_immutable(redis, keys):
    stream = Stream.prompts(redis, keys)
    await stream.ensure_group()
    await stream.add(Envelope("g", -1, b"x"))
    [d] = await stream.read("c", block_ms=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.deliveries = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.envelope.group_id = "h"


async def test_ensure_group_raises_what_is_not_an_existing_group(redis, keys):
    from redis.exceptions import ResponseError

    stream = Stream.prompts(redis, keys)
    await redis.set(keys.prompts, b"not a stream")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await stream.ensure_group()


async def test_read_defaults_to_one_entry_and_ack_of_nothing_is_zero(redis, keys):
    stream = Stream.prompts(redis, keys)
    await stream.ensure_group()
    ids = await stream.add_many([Envelope(g, -1, b"") for g in "abc"])  # with their ledger entries between
    assert ids == [entry_id for entry_id, _ in await redis.xrange(keys.prompts)]
    assert [d.envelope.group_id for d in await stream.read("c", block_ms=None)] == ["a"]
    assert await stream.ack([]) == 0
    [d] = await stream.read("c", block_ms=None)
    with pytest.raises(ValueError):  # one detail per delivery, or one for all
        await stream.ack([d], event="trained", details=[{}, {}])


async def test_the_fifth_delivery_is_the_last_by_default(redis, keys):
    stream = Stream.trajectories(redis, keys, visibility_timeout_s=0.01)
    await stream.ensure_group()
    await stream.add(Envelope("poison", 0, b"x"))
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while not await stream.dead_letters():
        assert time.monotonic() < deadline, seen
        seen += [d.deliveries for d in await stream.read("c", block_ms=None)]
        await asyncio.sleep(0.02)
    assert seen == [1, 2, 3, 4, 5]


async def test_an_entry_deleted_while_pending_is_not_redelivered(redis, keys):
    stream = Stream.prompts(redis, keys, visibility_timeout_s=0.01)
    await stream.ensure_group()
    await stream.add(Envelope("gone", -1, b""))
    [d] = await stream.read("c", block_ms=None)
    await redis.xdel(keys.prompts, d.entry_id)
    await asyncio.sleep(0.05)  # past the visibility timeout: only longer on a loaded machine
    assert await stream.read("c2", block_ms=None) == []
    assert await stream.pending() == 0


async def test_handoff_returns_the_new_entry_or_none_when_done(redis, keys):
    prompts, traj = Stream.prompts(redis, keys, visibility_timeout_s=0.01), Stream.trajectories(redis, keys)
    await prompts.ensure_group()
    await traj.ensure_group()
    await prompts.add(Envelope("g", -1, b""))
    [first] = await prompts.read("a", block_ms=None)
    await asyncio.sleep(0.05)
    [again] = await prompts.read("b", block_ms=None)  # redelivered: two servers hold it
    new_id = await prompts.handoff(first, traj, Envelope("g", 0, b"t"))
    assert [entry_id for entry_id, _ in await redis.xrange(keys.trajectories)] == [new_id]
    assert await prompts.handoff(again, traj, Envelope("g", 0, b"t")) is None


async def test_acked_events_reach_the_ledger_without_details(redis, keys):
    from broker.ledger import Ledger

    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    await stream.add(Envelope("g", 0, b""))
    await stream.ack(await stream.read("learner", block_ms=None), counter="accepted", event="trained")
    assert [(e["e"], e["g"]) for e in await Ledger(redis, keys).read()] == [("trained", "g")]


async def test_touch_keeps_held_entries_from_redelivery(redis, keys):
    stream = Stream.trajectories(redis, keys, visibility_timeout_s=1.0)
    await stream.ensure_group()
    await stream.add(Envelope("held", 0, b""))
    held = await stream.read("learner", block_ms=None)
    deadline = time.monotonic() + 30
    while await stream.redis.xpending_range(keys.trajectories, stream.group, "-", "+", 1, idle=1000) == []:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)  # until the entry is past its visibility timeout: due for redelivery
    await stream.touch("learner", held)
    assert await stream.read("other", block_ms=None) == []  # idle time reset: not redelivered (for 1 s)
    [info] = await stream.redis.xpending_range(keys.trajectories, stream.group, "-", "+", 1)
    assert info["times_delivered"] == 1 and info["consumer"] == b"learner"


async def test_close_drops_every_entry_left_page_by_page(redis, keys):
    from broker.ledger import Ledger

    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    await prompts.add_many([Envelope(f"g{i}", -1, b"") for i in range(5)])
    await prompts.read("c", count=2, block_ms=None)  # two pending, three unread
    assert await prompts.close("run stopped", page=2) == 5
    assert await prompts.backlog() == 0 and await prompts.pending() == 0
    assert all([await prompts.is_done(f"g{i}") for i in range(5)])
    dropped = [e for e in await Ledger(redis, keys).read() if e["e"] == "dropped"]
    assert sorted(e["g"] for e in dropped) == [f"g{i}" for i in range(5)]
    assert {e["d"]["reason"] for e in dropped} == {"run stopped"}
    assert await prompts.close("again") == 0


async def test_dead_letters_record_their_stream_version_and_reason(redis, keys):
    from broker.ledger import Ledger

    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    await redis.xadd(keys.trajectories, {"g": "bad", "v": "not-an-int", "p": b""})
    assert await stream.read("learner", block_ms=None) == []
    [dead] = await stream.dead_letters()
    assert dead["g"] == "bad" and dead["v"] == "-1"  # NO_VERSION: no policy produced it
    [dropped] = [e for e in await Ledger(redis, keys).read() if e["e"] == "dropped"]
    assert dropped["d"]["stream"] == "trajectories" and dropped["d"]["reason"] == "dead_lettered"
    await stream.add(Envelope("long", 0, b""))
    [d] = await stream.read("learner", block_ms=None)
    await stream.dead_letter(d, "x" * 5000)
    why = [e for e in await Ledger(redis, keys).read() if e["g"] == "long"][0]["d"]["why"]
    assert why == "x" * 300
    assert (await stream.dead_letters())[0]["reason"] == "x" * 2000
    for i in range(101):
        await redis.xadd(keys.dead(keys.trajectories), {"g": f"d{i}"})
    assert len(await stream.dead_letters()) == 100


async def test_read_returns_at_most_count_when_some_are_reclaimed(redis, keys):
    stream = Stream.prompts(redis, keys, visibility_timeout_s=0.05)
    await stream.ensure_group()
    await stream.add(Envelope("old", -1, b""))
    [first] = await stream.read("a", block_ms=None)
    for i in range(3):
        await stream.add(Envelope(f"new{i}", -1, b""))
    time.sleep(0.1)  # "old" is past its visibility timeout: reclaimed first, then new ones fill up to count
    got = await stream.read("b", count=2, block_ms=None)
    assert [d.envelope.group_id for d in got] == ["old", "new0"]


async def test_a_producer_waiting_for_room_takes_it_soon_after_it_appears(redis, keys):
    """Stream.add(wait_s=...) retries a full stream with a back-off from 10 ms, doubling: room that
    appears t seconds into the wait is taken at the next try, by about 2t, not near the end of
    wait_s (two times measured in this test; the 0.5 s is slack for a loaded machine)."""
    stream = Stream(redis, keys, keys.prompts, "rollout", maxlen=1)
    await stream.ensure_group()
    await stream.add(Envelope("p0", -1, b"x"))
    started = time.monotonic()
    producer = asyncio.create_task(stream.add(Envelope("p1", -1, b"x"), wait_s=30))
    await asyncio.sleep(0.05)
    assert not producer.done()  # still waiting for room
    await stream.ack(await stream.read("c", count=1, block_ms=None))
    freed = time.monotonic() - started
    await producer
    took = time.monotonic() - started
    assert took < 2 * freed + 0.5, f"room appeared after {freed:.2f} s, the producer took it after {took:.2f} s"
    assert [d.envelope.group_id for d in await stream.read("c", count=10, block_ms=None)] == ["p1"]
