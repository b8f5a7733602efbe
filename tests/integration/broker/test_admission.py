"""Admission control and acceptance (docs/architecture.md section 3) against a real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import Admission, Envelope, Keys, Stream, WeightRegistry, accept, connect
from broker.admission import lag
from broker.weight_versions import VersionConflict, WeightVersion


def _wv(v: int) -> WeightVersion:
    return WeightVersion(version=v, uri=f"/w/{v}", sha256="a" * 64, created_at=time.time())


def test_accept_rule():
    assert accept(5, 5, 0) and not accept(5, 4, 0)
    assert accept(5, 3, 2) and not accept(5, 2, 2)
    assert not accept(5, 6, 3)  # from the future


async def test_capacity_holds_under_concurrent_reservations(redis, keys):
    adm = Admission(redis, keys, max_staleness=1, groups_per_step=4)
    decisions = await asyncio.gather(*[adm.try_reserve(0) for _ in range(40)])
    assert sum(d.ticket is not None for d in decisions) == adm.capacity == 8
    assert {d.reason for d in decisions if d.ticket is None} == {"full"}
    await adm.release(next(d.ticket for d in decisions if d.ticket))
    assert (await adm.try_reserve(0)).reason == "admitted"


async def test_stale_rollout_is_refused_until_it_loads(redis, keys):
    adm = Admission(redis, keys, max_staleness=1, groups_per_step=2)
    reg = WeightRegistry(redis, keys)
    for v in (1, 2):
        await reg.publish(_wv(v))
    d = await adm.try_reserve(0)
    assert (d.reason, d.latest_version) == ("stale", 2)
    assert (await adm.try_reserve(1)).reason == "admitted"
    assert (await adm.reserve(0, timeout_s=5)).reason == "stale"  # returns at once: waiting can't help


async def test_a_group_that_could_only_be_trained_too_late_is_not_started(redis, keys):
    # eta 1, 2 groups a step: at lag 1 a group is trained in the step now waiting or running, or never
    adm = Admission(redis, keys, max_staleness=1, groups_per_step=2)
    reg = WeightRegistry(redis, keys)
    ahead = [(await adm.try_reserve(0)).ticket for _ in range(2)]  # the batch the learner trains into version 1
    await reg.publish(_wv(1))
    d = await adm.try_reserve(0)  # a third group from version 0 would be trained at the step to version 3: lag 2
    assert (d.reason, d.latest_version, d.outstanding) == ("stale", 1, 2)
    await adm.release(ahead[0])
    assert (await adm.try_reserve(0)).reason == "admitted"  # the one slot left in the step to version 2
    assert (await adm.try_reserve(0)).reason == "stale"
    assert [(await adm.try_reserve(1)).reason for _ in range(3)] == ["admitted", "admitted", "full"]


async def test_expired_lease_frees_the_slot(redis, keys):
    adm = Admission(redis, keys, max_staleness=0, groups_per_step=1, lease_s=0.2)
    held = await adm.try_reserve(0)
    assert (await adm.try_reserve(0)).reason == "full"
    assert await adm.renew(held.ticket)
    # The holder died: no renewal. Wait for the expiry itself (a loaded machine may take longer than 0.2 s
    # to get here); until then the slot stays taken.
    deadline = time.monotonic() + 10
    while (d := await adm.try_reserve(0)).reason == "full":
        assert time.monotonic() < deadline, "the 0.2 s lease never expired"
        await asyncio.sleep(0.05)
    assert d.reason == "admitted"
    assert not await adm.renew(held.ticket)


async def test_registry_versions_are_consecutive_and_notify(redis, keys):
    reg = WeightRegistry(redis, keys)
    assert await reg.latest() is None and await reg.latest_version() == 0
    await reg.publish(_wv(1))
    with pytest.raises(VersionConflict, match="latest is 1"):
        await reg.publish(_wv(3))
    with pytest.raises(VersionConflict):
        await reg.publish(_wv(1))
    # The notification itself: a subscriber sees the new version on the channel (wait_newer also
    # polls ``latest`` every second, so a waiter alone would not notice a missing PUBLISH).
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.weights_channel)
    waiter = asyncio.create_task(reg.wait_newer(1, timeout_s=30))
    await reg.publish(_wv(2))
    deadline = time.monotonic() + 10
    message = None
    while message is None and time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
    await pubsub.aclose()
    assert message is not None and message["data"] == b"2", message
    assert (await waiter).version == 2
    assert await reg.wait_newer(2, timeout_s=0.1) is None
    assert [w.version for w in await reg.history()] == [1, 2]
    await reg.report_in_use("rollout-a", 2)
    assert await reg.in_use() == {"rollout-a": 2}


async def _simulate(url: str, eta: int, groups_per_step: int, schedule: list[tuple[str, int]]) -> dict:
    """Rollout workers and a learner interleaved by ``schedule``; returns what the learner trained."""
    redis = connect(url)
    keys = Keys(f"prop-{uuid.uuid4().hex[:16]}")  # not random: hypothesis seeds it
    prompts, traj = Stream.prompts(redis, keys), Stream.trajectories(redis, keys)
    await prompts.ensure_group()
    await traj.ensure_group()
    adm = Admission(redis, keys, max_staleness=eta, groups_per_step=groups_per_step)
    reg = WeightRegistry(redis, keys)
    await prompts.add_many([Envelope(f"g{i}", -1, b"") for i in range(len(schedule) + 1)])

    loaded = [0, 0, 0]
    in_flight: list[list] = [[], [], []]
    version, batch, trained, max_outstanding = 0, [], [], 0
    for action, w in schedule:
        if action == "admit":
            d = await adm.try_reserve(loaded[w])
            if d.reason == "stale":
                at_lag = d.latest_version - loaded[w]
                assert at_lag > eta or d.outstanding >= (eta + 1 - at_lag) * groups_per_step
                loaded[w] = d.latest_version
            elif d.ticket is not None:
                assert d.latest_version - loaded[w] <= eta
                got = await prompts.read(f"w{w}", count=1, block_ms=None)
                if got:
                    in_flight[w].append((got[0], d.ticket, loaded[w]))
                else:
                    await adm.release(d.ticket)
        elif action == "finish" and in_flight[w]:
            delivery, ticket, v = in_flight[w].pop(0)
            await prompts.handoff(delivery, traj, Envelope(delivery.envelope.group_id, v, b""), ticket.token)
        elif action == "load":
            loaded[w] = await reg.latest_version()
        elif action == "learn":
            for d in await traj.read("learner", count=groups_per_step - len(batch), block_ms=None):
                if accept(version, d.envelope.policy_version, eta):
                    batch.append(d)
                else:
                    await traj.ack([d], counter="stale_dropped")
            if len(batch) == groups_per_step:
                trained += [(version + 1, d.envelope.group_id, d.envelope.policy_version) for d in batch]
                version += 1
                await reg.publish(_wv(version))
                await traj.ack(batch, counter="accepted")  # after the publish, as the learner does
                batch = []
        max_outstanding = max(max_outstanding, await adm.outstanding())
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    await redis.aclose()
    return {"trained": trained, "max_outstanding": max_outstanding, "capacity": adm.capacity, **counters}


actions = st.lists(
    st.tuples(st.sampled_from(["admit"] * 3 + ["finish"] * 3 + ["learn"] * 2 + ["load"]), st.integers(0, 2)),
    min_size=20, max_size=300,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(eta=st.integers(0, 3), groups_per_step=st.integers(1, 4), schedule=actions)
def test_no_group_beyond_eta_is_ever_trained(redis_url, eta, groups_per_step, schedule):
    out = asyncio.run(_simulate(redis_url, eta, groups_per_step, schedule))
    for produced_version, _gid, v in out["trained"]:
        v_learner = produced_version - 1
        assert 0 <= v_learner - v <= eta
        if eta == 0:
            assert v == v_learner  # exactly on-policy: generated by the preceding version
    ids = [gid for _, gid, _ in out["trained"]]
    assert len(ids) == len(set(ids))  # trained at most once
    assert out["max_outstanding"] <= out["capacity"]
    if eta == 0:
        assert out.get("stale_dropped", 0) == 0  # admission makes on-policy drops impossible


# -- edges that bench/mutation.py found untested (each test names what it guards) -----------------


def test_retracted_versions_do_not_count_towards_the_lag():
    assert lag(5, 2) == 3
    assert lag(5, 2, {3, 4}) == 1  # two of the three versions since 2 were withdrawn
    assert lag(5, 2, {5}) == 2  # the learner's own version counts when retracted
    assert lag(5, 2, {2, 6}) == 3  # neither the group's version nor one beyond the learner is "between"
    assert accept(5, 2, 1, {3, 4}) and not accept(5, 2, 1, {3})
    assert not accept(5, 4, 1, {4})  # generated by a retracted version


async def test_admission_refuses_impossible_settings(redis, keys):
    with pytest.raises(ValueError, match="max_staleness"):
        Admission(redis, keys, max_staleness=-1, groups_per_step=1)
    with pytest.raises(ValueError, match="groups_per_step"):
        Admission(redis, keys, max_staleness=0, groups_per_step=0)
    assert Admission(redis, keys, max_staleness=0, groups_per_step=1).capacity == 1


async def test_default_lease_and_decisions_are_fixed(redis, keys):
    adm = Admission(redis, keys, max_staleness=0, groups_per_step=1)
    assert adm.lease_s == 300.0  # the actor renews every lease_s / 3 (100 s)
    d = await adm.try_reserve(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.reason = "full"
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.ticket.token = "someone else's"


class CountingAdmission(Admission):
    """Counts the admission checks :meth:`Admission.reserve` makes while it waits."""

    tries = 0

    async def try_reserve(self, loaded_version: int):
        self.tries += 1
        return await super().try_reserve(loaded_version)


async def test_reserve_waits_for_a_full_run_then_gives_up(redis, keys):
    adm = CountingAdmission(redis, keys, max_staleness=0, groups_per_step=1)
    assert (await adm.try_reserve(0)).reason == "admitted"
    adm.tries = 0
    t0 = time.monotonic()
    d = await adm.reserve(0, timeout_s=1.0)
    took = time.monotonic() - t0
    assert d.reason == "full" and d.ticket is None
    assert took >= 1.0  # it waited out its timeout (a loaded machine only makes this longer)
    assert 3 <= adm.tries <= 1.0 / 0.05 + 2  # polled every 0.05 s: neither once nor a busy loop


async def test_reserve_gets_the_slot_a_holder_releases(redis, keys):
    adm = CountingAdmission(redis, keys, max_staleness=0, groups_per_step=1)
    held = await adm.try_reserve(0)
    adm.tries = 0
    waiter = asyncio.create_task(adm.reserve(0, timeout_s=60))
    deadline = time.monotonic() + 30
    while adm.tries < 2:  # it found the run full and is waiting
        assert time.monotonic() < deadline and not waiter.done(), (adm.tries, waiter)
        await asyncio.sleep(0.01)
    await adm.release(held.ticket)
    d = await asyncio.wait_for(waiter, 30)
    assert d.reason == "admitted" and d.ticket is not None and d.ticket.loaded_version == 0


async def test_counts_split_queued_from_in_flight(redis, keys):
    adm = Admission(redis, keys, max_staleness=1, groups_per_step=2)
    prompts, traj = Stream.prompts(redis, keys), Stream.trajectories(redis, keys)
    await prompts.ensure_group()
    await traj.ensure_group()
    await prompts.add_many([Envelope("g0", -1, b""), Envelope("g1", -1, b"")])
    tickets = [(await adm.try_reserve(0)).ticket for _ in range(3)]
    [delivery] = await prompts.read("w", count=1, block_ms=None)
    await prompts.handoff(delivery, traj, Envelope(delivery.envelope.group_id, 0, b""), tickets[0].token)
    assert await adm.counts() == {"queued": 1, "in_flight": 2}
    assert await adm.outstanding() == 3
    [done] = await traj.read("learner", count=1, block_ms=None)
    await traj.ack([done], counter="accepted")
    assert await adm.counts() == {"queued": 0, "in_flight": 2}


async def test_reserve_ends_although_the_redis_client_lost_its_cancellation(redis, keys):
    """broker.streams.raise_if_cancelled in Admission.reserve: redis-py 8.1 on Python 3.11 can
    swallow a cancellation inside a command (the double below does what it does).

    The cancellation lands inside the command every time (the test waits until the double is in
    it): one that lands in reserve's own sleep between tries ends the task without the check, so
    an earlier version that cancelled after a fixed 0.1 s caught a missing check only when that
    instant fell inside a command (bench/mutation.py's loaded runs missed it). Without the check
    reserve polls on until its timeout and returns a "full" decision instead of being cancelled."""
    in_command = asyncio.Event()

    class Swallowing(Admission):
        async def try_reserve(self, loaded_version):
            in_command.set()
            try:
                await asyncio.sleep(1.0)  # the command in flight
            except asyncio.CancelledError:
                pass  # the command completes, the cancellation is gone
            return await super().try_reserve(loaded_version)

    assert (await Admission(redis, keys, max_staleness=0, groups_per_step=1).try_reserve(0)).ticket is not None
    adm = Swallowing(redis, keys, max_staleness=0, groups_per_step=1)  # the run is full from here on
    task = asyncio.create_task(adm.reserve(0, timeout_s=3.0, poll_s=0.01))
    await in_command.wait()  # the task is inside its first command now
    task.cancel()
    await asyncio.wait({task}, timeout=60)  # either way it ends: cancelled, or at its 3 s timeout
    assert task.cancelled(), f"reserve kept polling after its task was cancelled: {task.result()}"


async def test_a_registry_skips_only_retracted_numbers(redis, keys):
    """A version broadcast in memory whose learner died before its files is retracted at the resume,
    never registered: the next publish skips its number, and only such numbers (learner.trainer)."""
    reg = WeightRegistry(redis, keys)
    await reg.publish(_wv(1))
    await reg.retract([2], checkpoint_step=1)
    with pytest.raises(VersionConflict, match="latest is 1"):
        await reg.publish(_wv(4))  # 3 was not retracted
    await reg.publish(_wv(3))
    assert await reg.latest_version() == 3 and [w.version for w in await reg.history()] == [1, 3]
