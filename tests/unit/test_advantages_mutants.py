"""Edges of the advantage estimators that bench/mutation.py found untested: the refusals and the
zero-variance boundary."""

from __future__ import annotations

import pytest

from learner.advantages import ZERO_VARIANCE_TOL, group_advantages, has_signal


def test_a_spread_of_exactly_the_tolerance_is_no_signal():
    assert not has_signal([0.0, ZERO_VARIANCE_TOL])
    assert has_signal([0.0, 2 * ZERO_VARIANCE_TOL])


def test_an_empty_group_is_refused_with_its_reason():
    for kind in ("grpo", "dr_grpo", "rloo"):
        with pytest.raises(ValueError, match="at least one reward"):
            group_advantages([], kind)


def test_one_completion_has_a_dr_grpo_advantage_but_no_baseline_for_the_others():
    assert group_advantages([1.0], "dr_grpo") == [0.0]
    for kind in ("grpo", "rloo"):
        with pytest.raises(ValueError, match="at least 2 completions"):
            group_advantages([1.0], kind)


def test_an_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        group_advantages([0.0, 1.0], "ppo")
