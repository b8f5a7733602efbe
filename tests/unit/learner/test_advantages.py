"""The advantage estimators (learner.advantages) against values worked out by hand, their refusals
and the zero-variance boundary."""

from __future__ import annotations

import math

import pytest

from learner.advantages import ZERO_VARIANCE_TOL, group_advantages, has_signal


def test_grpo_advantages_use_the_sample_std():
    a = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    std = math.sqrt((4 * 0.25) / 3)  # sample std of {1,0,0,1} around 0.5
    assert a == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)])
    assert a[0] == pytest.approx(0.8660, abs=1e-4)


def test_dr_grpo_advantages_are_mean_centred_only():
    assert group_advantages([2.0, 0.0, 1.0], "dr_grpo") == pytest.approx([1.0, -1.0, 0.0])


def test_rloo_advantages_leave_one_out():
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert group_advantages([3.0, 1.0], "rloo") == pytest.approx([2.0, -2.0])


def test_zero_variance_groups_have_no_signal():
    assert not has_signal([1.0, 1.0, 1.0])
    assert has_signal([1.0, 1.0, 0.5])
    assert group_advantages([1.0, 1.0], "grpo") == [0.0, 0.0]


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
