"""The rollout autoscaler's decisions (deploy.autoscale.decide), replayed from a recorded backlog.

Each row is one look (every 30 s): what the run's Redis keys said, and the containers the autoscaler
must then keep. Policy under test: [modal.autoscale] defaults (up after 2 looks, down after 6, 120 s
of cool-down), [modal.rollout] min 1 / max 4, the run's admission capacity 8 ((eta + 1) * groups_per_step
with eta = 3, 2 groups a step).
"""

from __future__ import annotations

import pytest

from deploy.autoscale import Backlog, Bounds, State, decide, want
from deploy.config import Autoscale, ModalDeploy

POLICY = Autoscale()
MIN, MAX = 1, 4


def run(waiting: int, queued: int = 0, in_flight: int = 0, stale: int = 0, capacity: int = 8) -> Backlog:
    return Backlog(run_id="r1", waiting=waiting, queued=queued, in_flight=in_flight, capacity=capacity,
                   groups_per_step=2, stale_dropped=stale)


IDLE = Backlog(run_id=None)

RECORDED = [  # (look, containers to keep after it, why)
    (IDLE, 1, "no run: the floor"),
    (run(80, in_flight=1), 1, "work waits, admission open: once is not enough"),
    (run(78, in_flight=2), 2, "twice in a row: one more"),
    (run(75, in_flight=3), 2, "cooling down (30 s after the change)"),
    (run(71, in_flight=4), 2, "cooling down (60 s)"),
    (run(69, in_flight=4), 2, "cooling down (90 s)"),
    (run(66, in_flight=5), 3, "120 s after the change, still more wanted: one more"),
    (run(60, queued=1, in_flight=6, stale=1), 3, "a stale drop: too far ahead; fewer, once"),
    (run(58, queued=2, in_flight=6, stale=1), 3, "admission full and a step waits for the learner: fewer"),
    (run(57, queued=2, in_flight=6, stale=1), 3, "fewer (3)"),
    (run(57, queued=3, in_flight=5, stale=1), 3, "fewer (4)"),
    (run(56, queued=4, in_flight=4, stale=1), 3, "fewer (5)"),
    (run(55, queued=4, in_flight=4, stale=1), 2, "six in a row: one fewer"),
    (run(50, queued=0, in_flight=2, stale=1), 2, "admission open again, once"),
    (run(49, queued=4, in_flight=4, stale=1), 2, "full again: the streak of 'more' is broken"),
    (run(45, queued=0, in_flight=2, stale=1), 2, "more, once"),
    (run(44, queued=0, in_flight=2, stale=1, capacity=1), 1, "the run's capacity caps the fleet at once"),
]


def test_the_recorded_backlog_gives_these_decisions():
    state, t = State(containers=MIN), 0.0
    for i, (look, keep, why) in enumerate(RECORDED):
        state, decision = decide(look, state, Bounds.of(MIN, MAX, look), POLICY, now=t)
        assert decision.containers == keep, (i, why, decision)
        assert state.containers == keep
        t += 30.0


def test_it_never_leaves_the_bounds_and_never_changes_by_more_than_one_a_look():
    state, t = State(containers=MIN), 0.0
    looks = [run(100, in_flight=i % 8) for i in range(60)]  # work waiting all along
    seen = []
    for look in looks:
        before = state.containers
        state, decision = decide(look, state, Bounds.of(MIN, MAX, look), POLICY, now=t)
        assert MIN <= decision.containers <= MAX and abs(decision.containers - before) <= 1
        seen.append(decision.containers)
        t += 30.0
    assert seen[-1] == MAX  # and it got there
    assert [seen.index(n) for n in (2, 3, 4)] == [1, 5, 9]  # 2 looks, then one step per cool-down (4 looks)


def test_a_flapping_backlog_changes_nothing():
    state, t = State(containers=2), 0.0
    for i in range(40):
        look = run(50, in_flight=1) if i % 2 else run(50, queued=4, in_flight=4)
        state, decision = decide(look, state, Bounds.of(MIN, MAX, look), POLICY, now=t)
        assert decision.containers == 2 and not decision.changed
        t += 30.0


@pytest.mark.parametrize(("look", "wish"), [
    (IDLE, "fewer"),
    (run(0, in_flight=3), "fewer"),  # nothing left to generate
    (run(5, stale=2), "fewer"),
    (run(5, queued=2, in_flight=6), "fewer"),  # full, a step waits for the learner
    (run(5, queued=1, in_flight=7), "hold"),  # full, mostly generating: more would not help, fewer might hurt
    (run(5, queued=0, in_flight=3), "more"),
])
def test_what_one_look_asks_for(look, wish):
    assert want(look, stale_seen=0) == wish


def test_the_autoscaler_needs_a_top():
    with pytest.raises(ValueError, match="modal.rollout.max_containers"):
        ModalDeploy.model_validate({"rollout": {"gpu": "H100:1", "max_containers": None}})
    ModalDeploy.model_validate({"rollout": {"gpu": "H100:1", "max_containers": None}, "autoscale": {"enabled": False}})
