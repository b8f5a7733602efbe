"""The rollout autoscaler against real Redis: it reads the active run's backlog from the keys the control
plane, rollout servers and learner keep, remembers its state between looks in Redis, and sets the
rollout class's containers through its autoscaler (``deploy.modal_app._scale_rollout``), here a spy standing in for
Modal's cloud (it records the keyword arguments)."""

from __future__ import annotations

from broker import Admission, Envelope, Keys, Stream
from broker.streams import NO_VERSION
from deploy.autoscale import Backlog, read_backlog, tick
from deploy.config import Autoscale
from services.runs import RunStore
from tests.fixtures.control import run_config

GROUPS = 10


class UpdateAutoscalerSpy:
    """Stands in for ``deploy.modal_app._scale_rollout`` (Modal's cloud): records each call."""

    def __init__(self):
        self.calls: list[dict] = []

    async def __call__(self, **kw) -> None:
        self.calls.append(kw)


async def test_ticks_read_the_backlog_and_set_the_rollout_containers(control_redis):
    assert await read_backlog(control_redis) == Backlog(run_id=None)
    config = run_config(learner={"groups_per_step": 2, "steps": 5}, staleness={"max_staleness": 1})
    store = RunStore(control_redis)
    await store.create("scaled", "ps-x", config)
    keys = Keys("scaled")
    prompts = Stream.prompts(control_redis, keys)  # the run's prompt groups, as the control plane enqueued them
    await prompts.ensure_group()
    await prompts.add_many([Envelope(f"g{i}", NO_VERSION, b"prompt group") for i in range(GROUPS)])
    taken = await prompts.read("rollout-1", count=1)  # one group taken by a rollout server
    admission = Admission(control_redis, keys, max_staleness=1, groups_per_step=2)
    ticket = (await admission.try_reserve(0)).ticket
    backlog = await read_backlog(control_redis)
    assert backlog == Backlog(run_id="scaled", waiting=GROUPS - 1, queued=0, in_flight=1, capacity=4,
                              groups_per_step=2, stale_dropped=0)

    spy, policy = UpdateAutoscalerSpy(), Autoscale(up_after=2, down_after=2, cooldown_s=0)
    looks = []
    for t in range(3):  # more, more -> 2, more -> 3
        looks.append(await tick(control_redis, min_containers=1, max_containers=4, policy=policy, apply=spy, now=t))
    assert [d.containers for d in looks] == [1, 2, 2]
    assert spy.calls == [{"min_containers": 1, "max_containers": 4}, {"min_containers": 2, "max_containers": 4},
                         {"min_containers": 2, "max_containers": 4}]
    # the learner drops stale groups: the rollout side runs ahead; two such looks, one container fewer
    await control_redis.hincrby(keys.counters, "stale_dropped", 3)
    assert (await tick(control_redis, min_containers=1, max_containers=4, policy=policy, apply=spy, now=10)).containers == 2
    await control_redis.hincrby(keys.counters, "stale_dropped", 1)
    assert (await tick(control_redis, min_containers=1, max_containers=4, policy=policy, apply=spy, now=11)).containers == 1
    # the run ends: no active run, the floor
    await admission.release(ticket)
    await prompts.ack(taken, counter="generated")
    await store.stop("scaled")
    decision = await tick(control_redis, min_containers=1, max_containers=4, policy=policy, apply=spy, now=20)
    assert decision.containers == 1 and spy.calls[-1] == {"min_containers": 1, "max_containers": 4}
