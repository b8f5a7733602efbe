"""What a learner killed between a checkpoint and its acknowledgement leaves to the resume (real Redis).

The whole story (the learner SIGKILLed after a publish, mid-checkpoint and
after a checkpoint, under ``tandem run``, the audit and summary.json checked)
is ``tests/integration/deploy/test_main_job.py``; here, the accounting rule the
resume relies on, alone: the groups a checkpoint records as held are
acknowledged again at the resume (``learner.trainer.Trainer._resume``), and
those the killed learner had acknowledged already must be neither counted
nor recorded as trained twice, while the others are counted once.
"""

from __future__ import annotations

from broker import Envelope, Stream
from broker.ledger import Ledger
from services import wire


def _traj(group_id: str) -> bytes:
    s = wire.ScoredSample(token_ids=[1, 2], logprobs=[-0.5, -0.1], text="ab", finish_reason="stop",
                          policy_version=0, reward=1.0, status="ok")
    return wire.encode(wire.TrajectoryGroup(run_id="r", group_id=group_id, prompt="p", prompt_token_ids=[3],
                                            samples=[s], n=1, policy_version=0))


async def test_groups_acknowledged_again_at_a_resume_are_counted_and_recorded_once(redis, keys):
    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    ids = [f"g{i}" for i in range(5)]
    for gid in ids:
        await stream.add(Envelope(gid, 0, _traj(gid)))
    held = await stream.read("learner", count=5)
    assert [d.envelope.group_id for d in held] == ids
    # the checkpoint holds all five; the learner acknowledged three of them, then was killed
    await stream.ack(held[:3], counter="accepted", event="trained", details={"step": 1})
    # the resumed learner acknowledges the checkpoint's five (as Trainer._resume does)
    await stream.ack(held, counter="accepted", event="trained", details={"step": 1})
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    trained = [e["g"] for e in await Ledger(redis, keys).read() if e["e"] == "trained"]
    assert sorted(trained) == ids
    assert counters["accepted"] == len(ids), counters
    assert await stream.pending() == 0 and await stream.backlog() == 0
