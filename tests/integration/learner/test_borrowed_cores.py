"""The learner borrows the rollout server's cores only while no group of its run is in flight (real Redis,
the run's tickets as ``broker.Admission`` writes them, torch's own thread count)."""

from __future__ import annotations

import torch

from broker import Admission
from learner.borrowed_cores import BorrowedCores


async def test_the_learner_takes_the_rollout_cores_only_while_it_is_the_slower_side_and_nothing_is_in_flight(
        redis, redis_url, keys):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cores = BorrowedCores(redis_url, keys, own=1, borrow=1)
    admission = Admission(redis, keys, max_staleness=1, groups_per_step=2, lease_s=30)
    try:
        assert cores.apply() == 1  # no step yet: nothing says the learner is the slower side
        cores.step_ended(waited_s=0.2, busy_s=0.8)  # it waited a fifth of its time: the rollout side is slower
        assert cores.apply() == 1 and torch.get_num_threads() == 1
        for _ in range(9):  # ten steps that waited 0.2 s of 19.0 s in all: 1.1%, below the bound
            cores.step_ended(waited_s=0.0, busy_s=2.0)
        assert cores.learner_bound
        short = BorrowedCores(redis_url, keys, own=1, borrow=1)
        for _ in range(10):  # the learner the slower side, but its steps short: a second thread pays too little
            short.step_ended(waited_s=0.0, busy_s=0.6)
        assert not short.learner_bound and short.apply() == 1
        short.close()
        cores.lent_frac()
        assert cores.apply() == 2 and torch.get_num_threads() == 2  # nothing admitted: the rollout side waits
        decision = await admission.try_reserve(0)
        assert decision.ticket is not None  # a group in flight: back to the learner's own thread
        assert cores.apply() == 1 and torch.get_num_threads() == 1
        assert cores.apply() == 1
        # handed off, the group waits for the learner (score +inf, as the handoff script writes it): not in flight
        await redis.zadd(keys.tickets, {decision.ticket.token: float("inf")})
        assert await admission.counts() == {"queued": 1, "in_flight": 0}
        assert cores.apply() == 2 and torch.get_num_threads() == 2
        assert cores.lent_frac() == 0.5 and cores.lent_frac() is None  # 2 of 4 looks; a new step starts at 0
        cores.close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
