"""bench/pools.py: the pools simulation and the costs it reads from a run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.pools import Costs, measure_costs, simulate  # noqa: E402

MEASURED_LIKE = Costs(lat0_s=0.23, lat1_s=0.016, train_s=0.69, publish_s=0.012, reload_s=0.087, signal_frac=0.89)


def test_eta_0_is_strictly_serial():
    c = Costs(lat0_s=0.2, lat1_s=0.01, train_s=0.5, publish_s=0.0, reload_s=0.1)
    p = simulate(c, 1, 0)
    # reload, then the step's 16 groups batched (a lone group's latency + 15 more), train, publish
    assert p.step_s == pytest.approx(0.1 + 0.2 + 15 * 0.01 + 0.5, rel=1e-9)
    assert p.stale_frac == 0.0


def test_cpu_share_slows_generation_only():
    c = Costs(lat0_s=0.2, lat1_s=0.01, train_s=0.5, publish_s=0.0, reload_s=0.1)
    assert simulate(c, 1, 0, cpu_share=0.5).step_s == pytest.approx(0.1 + 2 * (0.2 + 15 * 0.01) + 0.5, rel=1e-9)


@pytest.mark.parametrize("eta", [2, 3, 4])
def test_enough_servers_reach_the_learner_bound(eta):
    # a new version reaches the learner as generated groups (drain + reload + generation) well within a step
    c = Costs(lat0_s=0.05, lat1_s=0.005, train_s=0.5, publish_s=0.05, reload_s=0.02)
    p = simulate(c, 8, eta)
    assert p.step_s == pytest.approx(c.train_s + c.publish_s, rel=1e-6)
    assert p.learner_idle < 0.05


@pytest.mark.parametrize("eta", [0, 2, 3, 4])
def test_throughput_does_not_fall_with_more_servers(eta):
    # not at eta = 1 (nor with a publish window at eta = 0): there more servers start more groups on a
    # version about to be replaced, and those go stale (the model's finding the 2-server run checks)
    costs = dataclasses.replace(MEASURED_LIKE, publish_s=0.0)
    steps = [simulate(costs, n, eta).step_s for n in range(1, 9)]
    assert all(b <= a * 1.01 for a, b in zip(steps, steps[1:], strict=False)), steps
    assert steps[-1] >= costs.train_s + costs.publish_s - 1e-9


def test_staleness_bound_holds_and_helps():
    # generation slower than the learner: a larger eta overlaps more of it
    slow = Costs(lat0_s=0.3, lat1_s=0.03, train_s=0.3, publish_s=0.01, reload_s=0.05)
    by_eta = [simulate(slow, 1, e) for e in range(3)]
    assert by_eta[1].step_s < by_eta[0].step_s and by_eta[2].step_s <= by_eta[1].step_s * 1.01
    for n in (1, 2, 4):
        for e in range(3):
            p = simulate(MEASURED_LIKE, n, e)
            assert p.max_lag <= e
    assert simulate(MEASURED_LIKE, 2, 1).stale_frac > 0  # the bound is enforced by dropping, here


def _ledger() -> list[dict]:
    rows, t = [], 1000.0
    # server "a": 10 lone groups of 0.2 s, then 10 groups at once finishing 0.5 s later
    for i in range(10):
        rows += [{"t": t * 1000, "e": "admitted", "g": f"s{i}", "d": {"server": "a"}},
                 {"t": (t + 0.2) * 1000, "e": "generated", "g": f"s{i}", "d": {"server": "a"}}]
        t += 1.0
    rows += [{"t": t * 1000, "e": "admitted", "g": f"b{i}", "d": {"server": "a"}} for i in range(10)]
    rows += [{"t": (t + 0.5) * 1000, "e": "generated", "g": f"b{i}", "d": {"server": "a"}} for i in range(10)]
    rows += [{"t": 2000_000, "e": "published", "g": "", "d": {"version": 1}},
             {"t": 2000_100, "e": "loaded", "g": "", "d": {"server": "a", "version": 1}},
             {"t": 2001_000, "e": "published", "g": "", "d": {"version": 2}},
             {"t": 2001_300, "e": "loaded", "g": "", "d": {"server": "a", "version": 2}},
             {"t": 2001_400, "e": "dropped", "g": "s0", "d": {"reason": "zero_variance"}},
             {"t": 2001_500, "e": "dropped", "g": "s1", "d": {"reason": "stale"}}]
    return rows


def test_costs_are_read_from_the_ledger_and_learner_points():
    points = [{"t": 100.0 + s, "tokens": 1000.0, "learner_tokens_per_s": 2000.0, "learner_idle_frac": 0.25}
              for s in range(5)]
    costs, derived = measure_costs(_ledger(), points, [{"total_s": 0.05}, {"total_s": 0.07}, {"total_s": 0.06}], 16)
    assert costs.lat0_s == pytest.approx(0.2, abs=1e-6)              # a lone group
    assert costs.lat1_s == pytest.approx((0.5 - 0.2) / 9, abs=1e-6)  # ten at once: 0.5 s
    assert costs.reload_s == pytest.approx(0.2)                      # median of 0.1 and 0.3
    assert costs.publish_s == pytest.approx(0.06)
    assert costs.train_s == pytest.approx(1.0 * 0.75 - 0.06)         # 1 s a step, busy 75%, less the publish
    assert costs.signal_frac == pytest.approx(1 - 1 / 20)
    assert derived["forward_backward_s"] == pytest.approx(0.5)
    assert derived["measured_step_s"] == pytest.approx(1.0)


def test_calibrate_scales_the_rollout_latencies_to_meet_a_measured_step():
    from bench.pools import calibrate

    c = Costs(lat0_s=0.2, lat1_s=0.01, train_s=0.5, publish_s=0.0, reload_s=0.1)
    target = simulate(c, 1, 0).step_s + 0.35  # at eta 0 the step grows with the latencies, so it is reachable
    cal, k = calibrate(c, target, 0)
    assert k > 1.0
    assert cal.lat1_s / cal.lat0_s == pytest.approx(c.lat1_s / c.lat0_s)
    assert simulate(cal, 1, 0).step_s == pytest.approx(target, rel=1e-3)
    assert (cal.train_s, cal.reload_s) == (c.train_s, c.reload_s)
