"""The learner's data path on a real Redis (learner.feeder): acceptance, dedupe, dead letters, take-over."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from learner.feeder import DataTimeout
from tests.fixtures.learner import add_group, make_group


def feeder_for(redis, keys, eta: int, *, filter_zero_variance: bool = True, consumer: str = "learner-test",
               visibility_timeout_s: float = 300.0, temperature: float = 1.0):
    from learner.feeder import Feeder
    from services.config import RunConfig

    cfg = RunConfig.model_validate({
        "model": {"path": "unused"}, "data": {"train": "unused"},
        "staleness": {"max_staleness": eta, "visibility_timeout_s": visibility_timeout_s},
        "loss": {"filter_zero_variance": filter_zero_variance}, "sampling": {"temperature": temperature},
    })
    return Feeder(redis, keys, cfg, vocab_size=90, max_len=128, consumer=consumer)


async def counters(redis, keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}


async def test_eta0_accepts_only_the_preceding_version(redis, keys):
    feeder = feeder_for(redis, keys, eta=0)
    await feeder.start()
    ids = {v: await add_group(redis, keys, v) for v in (1, 2, 3, 4)}  # v_learner = 3; 4 is "from the future"
    batch = await feeder.next_batch(3, 1, timeout_s=5)
    assert [g.group_id for _, g in batch] == [ids[3]]
    # the step producing v4 ran; acknowledge
    await feeder.ack_trained([d for d, _ in batch])
    c = await counters(redis, keys)
    assert c["stale_dropped"] == 2 and c["accepted"] == 1
    assert feeder.counts["stale_dropped"] == 2  # the feeder's own count (the learner's metrics) agrees
    # the v4 group is read at the next step and refused: accept() admits no group from the future
    with pytest.raises(DataTimeout):
        await feeder.next_batch(3, 1, timeout_s=1.5)
    assert (await counters(redis, keys))["stale_dropped"] == 3
    stream = feeder.stream
    for v in (1, 2, 4):
        assert await stream.is_done(ids[v])  # dropped groups are done too: never trained later
    assert await stream.backlog() == 0


async def test_eta2_drops_lag3_and_keeps_lag0_to_2(redis, keys):
    feeder = feeder_for(redis, keys, eta=2)
    await feeder.start()
    ids = {v: await add_group(redis, keys, v) for v in (2, 3, 4, 5)}  # lags 3, 2, 1, 0 at v_learner = 5
    batch = await feeder.next_batch(5, 3, timeout_s=5)
    assert sorted(g.policy_version for _, g in batch) == [3, 4, 5]
    c = await counters(redis, keys)
    assert c["stale_dropped"] == 1 and await feeder.stream.is_done(ids[2])
    # judged again at the next step: a buffered lag-2 group turns lag-3 and is dropped then
    late = await add_group(redis, keys, 3)
    with pytest.raises(DataTimeout):
        await feeder.next_batch(6, 1, timeout_s=1.5)
    assert await feeder.stream.is_done(late)
    assert (await counters(redis, keys))["stale_dropped"] == 2


async def test_bad_input_is_dead_lettered_with_a_reason(redis, keys):
    feeder = feeder_for(redis, keys, eta=1)
    await feeder.start()
    bad_token = await add_group(redis, keys, 0, bad="token")
    bad_lp = await add_group(redis, keys, 0, bad="logprobs")
    wrong_run_gid, payload = make_group("another-run", 0)
    from broker import Envelope

    await feeder.stream.add(Envelope(wrong_run_gid, 0, payload))
    await feeder.stream.add(Envelope("not-msgpack", 0, b"\xc1garbage"))
    good = await add_group(redis, keys, 0)
    batch = await feeder.next_batch(0, 1, timeout_s=5)
    assert [g.group_id for _, g in batch] == [good]
    reasons = {d["g"]: d["reason"] for d in await feeder.stream.dead_letters()}
    assert "vocab size 90" in reasons[bad_token]
    assert "logprobs" in reasons[bad_lp] and "token_ids" in reasons[bad_lp]
    assert "another-run" in reasons[wrong_run_gid]
    assert "msgpack" in reasons["not-msgpack"]
    assert feeder.counts["dead_lettered"] == 4


async def test_raw_logprobs_groups_are_refused_when_the_run_samples_at_another_temperature(redis, keys):
    """A rollout server started with raw_logprobs records the temperature-1 log-probs; a run at T = 0.7 needs
    those of softmax(logits / 0.7): its groups would bias every ratio, so they are dead-lettered, saying why."""
    feeder = feeder_for(redis, keys, eta=1, temperature=0.7)
    await feeder.start()
    raw = await add_group(redis, keys, 0, logprobs_mode="raw_logprobs")
    processed = await add_group(redis, keys, 0)
    batch = await feeder.next_batch(0, 1, timeout_s=5)
    assert [g.group_id for _, g in batch] == [processed]
    reasons = {d["g"]: d["reason"] for d in await feeder.stream.dead_letters()}
    assert "raw_logprobs" in reasons[raw] and "sampling.temperature = 0.7" in reasons[raw]
    # at temperature 1 with nothing else processing the logits the two modes are one distribution
    at_one = feeder_for(redis, keys, eta=1, consumer="learner-t1")
    assert at_one.cfg.sampling.logprobs_refusal("raw_logprobs") is None


async def test_zero_variance_groups_are_filtered_or_kept(redis, keys):
    import msgpack

    from broker import Envelope, Stream

    gid, payload = make_group(keys.run_id, 0)
    raw = msgpack.unpackb(payload)
    for s in raw["samples"]:
        s["reward"] = 1.0
    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    await stream.add(Envelope(gid, 0, msgpack.packb(raw)))
    feeder = feeder_for(redis, keys, eta=1)
    with pytest.raises(DataTimeout):
        await feeder.next_batch(0, 1, timeout_s=1.0)
    assert (await counters(redis, keys))["zero_variance_dropped"] == 1
    assert feeder.counts["zero_variance_dropped"] == 1
    gid2, _ = make_group(keys.run_id, 0)
    raw["group_id"] = gid2
    await stream.add(Envelope(gid2, 0, msgpack.packb(raw)))
    keeper = feeder_for(redis, keys, eta=1, filter_zero_variance=False)
    assert [g.group_id for _, g in await keeper.next_batch(0, 1, timeout_s=5)] == [gid2]


async def test_a_group_is_never_handed_out_twice(redis, keys):
    from broker import Envelope

    feeder = feeder_for(redis, keys, eta=1)
    await feeder.start()
    gid, payload = make_group(keys.run_id, 0)
    await feeder.stream.add(Envelope(gid, 0, payload))
    await feeder.stream.add(Envelope(gid, 0, payload))  # a producer that retried
    first = await feeder.next_batch(0, 1, timeout_s=5)
    await feeder.ack_trained([d for d, _ in first])
    with pytest.raises(DataTimeout):
        await feeder.next_batch(0, 1, timeout_s=1.0)
    # a redelivery of a group the learner still holds is ignored
    gid3 = await add_group(redis, keys, 0)
    got = await feeder.stream.read("learner-test", count=1, block_ms=1000)
    await feeder._admit(got)
    await feeder._admit(got)
    assert list(feeder.buffer) == [gid3]


async def test_start_takes_over_what_a_dead_learner_left_pending(redis, keys):
    dead = feeder_for(redis, keys, eta=1, consumer="learner-dead")
    await dead.start()
    gids = [await add_group(redis, keys, 0) for _ in range(3)]
    await dead.next_batch(0, 3, timeout_s=5)  # read, never acknowledged: the process "died"
    assert await dead.stream.pending() == 3
    fresh = feeder_for(redis, keys, eta=1, consumer="learner-new")
    assert await fresh.start() == 3
    assert list(fresh.buffer) == gids


@pytest.mark.slow  # over 5 s in make test-fast (docs/testing.md): make test runs it
async def test_held_groups_free_their_tickets_stay_out_of_the_buffer_and_are_kept_from_redelivery(redis, keys):
    """What bench/mutation.py found untested: hold(), the keep-alive of held entries, the ``handed``
    ledger entries and the idle time."""
    from broker import Admission, Envelope, Stream
    from broker.ledger import Ledger

    feeder = feeder_for(redis, keys, eta=1, visibility_timeout_s=2.4)  # above the 1 s read block it touches between
    assert feeder.idle_s == 0.0  # it has not waited for data yet
    assert await feeder.start() == 0  # nothing pending to take over
    adm, prompts = Admission(redis, keys, max_staleness=1, groups_per_step=1), Stream.prompts(redis, keys)
    await prompts.ensure_group()
    gid, payload = make_group(keys.run_id, 0)
    await prompts.add(Envelope(gid, -1, b""))
    ticket = (await adm.try_reserve(0)).ticket
    [prompt] = await prompts.read("rollout", block_ms=None)
    await prompts.handoff(prompt, feeder.stream, Envelope(gid, 0, payload), ticket.token)
    assert await adm.counts() == {"queued": 1, "in_flight": 0}

    batch = await feeder.next_batch(0, 1, timeout_s=5)
    handed = [e for e in await Ledger(redis, keys).read() if e["e"] == "handed"]
    assert [(e["g"], e["d"]["version"], e["d"]["delivery"]) for e in handed] == [(gid, 0, 1)]
    await feeder.hold([d for d, _ in batch])
    assert await adm.counts() == {"queued": 0, "in_flight": 0}  # the rollout servers may go on
    await feeder._admit([d for d, _ in batch])  # a redelivery of a held group
    assert list(feeder.buffer) == [] and list(feeder.held) == [gid]

    # waiting for the next step's data (5.5 s, over two visibility timeouts): the held entry is kept alive
    with pytest.raises(DataTimeout):
        await feeder.next_batch(1, 1, timeout_s=5.5)
    assert await feeder.stream.read("another-learner", block_ms=None) == []
    assert feeder.idle_s > 0.0


async def test_a_payload_under_another_group_id_is_dead_lettered(redis, keys):
    from broker import Envelope

    feeder = feeder_for(redis, keys, eta=1)
    await feeder.start()
    _gid, payload = make_group(keys.run_id, 0)
    await feeder.stream.add(Envelope("some-other-id", 0, payload))
    with pytest.raises(DataTimeout):
        await feeder.next_batch(0, 1, timeout_s=1.0)
    [dead] = await feeder.stream.dead_letters()
    assert dead["g"] == "some-other-id" and "differs from the payload's" in dead["reason"]
    assert feeder.counts["dead_lettered"] == 1


async def test_a_step_reads_only_the_groups_it_still_needs(redis, keys):
    feeder = feeder_for(redis, keys, eta=1)
    await feeder.start()
    for _ in range(5):
        await add_group(redis, keys, 0)
    await feeder._admit(await feeder.stream.read(feeder.consumer, count=1, block_ms=None))  # one buffered
    batch = await feeder.next_batch(0, 3, timeout_s=5)
    assert len(batch) == 3 and not feeder.buffer
    assert await feeder.stream.pending() == 3  # two more read for it; two left unread for later


async def test_a_stop_while_waiting_for_data_is_seen_at_the_end_of_the_current_read(redis, keys):
    """next_batch reads in blocks of at most 1 s and looks at ``stop`` between them, so a learner told to
    stop while no data comes returns None when the read it is in ends. Compared with the time one such
    read takes in this test (a DataTimeout after timeout_s=1.0 is one 1 s read), so load slows both."""
    feeder = feeder_for(redis, keys, eta=1)
    await feeder.start()
    started = time.monotonic()
    with pytest.raises(DataTimeout):
        await feeder.next_batch(0, 1, timeout_s=1.0)
    one_read = time.monotonic() - started
    stop = threading.Event()
    started = time.monotonic()
    asyncio.get_running_loop().call_later(0.2, stop.set)  # inside the first read
    assert await feeder.next_batch(0, 1, timeout_s=30, stop=stop) is None
    took = time.monotonic() - started
    assert took < 1.5 * one_read, f"stopped after {took:.2f} s; one read takes {one_read:.2f} s"
