"""Parts of learner/loss.py that bench/mutation.py found untested: the statistics' arithmetic and
the refusals (each test names what it guards)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import LossStats, aggregation_coefs, token_loss
from services.config import LossConfig

FIELDS = ("tokens", "loss", "pg_loss", "kl_sum", "entropy_sum", "clipped", "is_weight_sum", "is_capped")


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregation_coefs("mean", [1, 2], None)


def test_stats_start_at_zero_and_summarise_an_empty_batch():
    empty = LossStats()
    assert [getattr(empty, name) for name in FIELDS] == [0.0] * len(FIELDS) and empty.is_weight_max == 0.0
    assert set(empty.summary().values()) == {0.0}  # no tokens: no division by zero


def test_stats_merge_add_up_and_keep_the_largest_weight():
    a = LossStats.from_vector([float(i + 1) for i in range(len(FIELDS))], is_weight_max=3.0)
    b = LossStats.from_vector([10.0 * (i + 1) for i in range(len(FIELDS))], is_weight_max=2.0)
    assert [getattr(a, name) for name in FIELDS] == [float(i + 1) for i in range(len(FIELDS))]
    assert a.as_vector() == [float(i + 1) for i in range(len(FIELDS))]
    a.merge(b)
    assert a.as_vector() == [11.0 * (i + 1) for i in range(len(FIELDS))]
    assert a.is_weight_max == 3.0
    b.merge(LossStats(is_weight_max=5.0))
    assert b.is_weight_max == 5.0
    s = a.summary()
    assert s["tokens"] == 11.0 and s["loss"] == 22.0 and s["pg_loss"] == 33.0
    assert s["kl"] == pytest.approx(44.0 / 11) and s["entropy"] == pytest.approx(55.0 / 11)
    assert s["clip_fraction"] == pytest.approx(66.0 / 11) and s["is_weight_mean"] == pytest.approx(77.0 / 11)
    assert s["is_capped_fraction"] == pytest.approx(88.0 / 11) and s["is_weight_max"] == 3.0


def test_entropy_bonus_needs_the_entropy():
    c = LossConfig(off_policy="none", beta=0.0, entropy_coef=0.01)
    with pytest.raises(ValueError, match="per-token entropy"):
        token_loss(c, logp=t([[0.0]]), behav_logp=t([[0.0]]), advantages=t([0.0]), mask=t([[1]]), coef=t([[1.0]]))


def test_kl_is_reported_without_a_kl_penalty():
    c = LossConfig(off_policy="none", beta=0.0, entropy_coef=0.0, kl_estimator="k1")
    loss, st = token_loss(c, logp=t([[math.log(0.5)]]), behav_logp=t([[math.log(0.5)]]), advantages=t([0.0]),
                          mask=t([[1]]), coef=t([[1.0]]), ref_logp=t([[math.log(0.4)]]))
    assert loss.item() == 0.0
    assert st.kl_sum == pytest.approx(math.log(0.5 / 0.4))


def test_from_vector_refuses_a_vector_of_the_wrong_length():
    with pytest.raises(ValueError):
        LossStats.from_vector([1.0] * (len(FIELDS) - 1), is_weight_max=0.0)


def test_clip_fraction_at_the_edges_of_the_clip_range():
    """A token counts as clipped only when the clipped branch wins: ratio strictly outside [low, high]
    on the side where the advantage pushes it further."""
    c = LossConfig(off_policy="none", beta=0.0, entropy_coef=0.0, eps_low=0.0, eps_high=0.0)  # low = high = 1
    on_the_edge = dict(logp=t([[0.0, 0.0]]), behav_logp=t([[0.0, 0.0]]), mask=t([[1, 1]]), coef=t([[1.0, 1.0]]))
    for adv in (-0.5, 0.5):
        _loss, st = token_loss(c, advantages=t([adv]), **on_the_edge)
        assert st.clipped == 0.0  # ratio exactly 1: inside the range on both sides
    c = LossConfig(off_policy="none", beta=0.0, entropy_coef=0.0, eps_low=0.2, eps_high=0.2)
    low = dict(logp=t([[math.log(0.5)]]), behav_logp=t([[0.0]]), mask=t([[1]]), coef=t([[1.0]]))  # ratio 0.5
    high = dict(logp=t([[0.0]]), behav_logp=t([[math.log(0.5)]]), mask=t([[1]]), coef=t([[1.0]]))  # ratio 2
    assert token_loss(c, advantages=t([-0.5]), **low)[1].clipped == 1.0
    assert token_loss(c, advantages=t([0.0]), **low)[1].clipped == 0.0
    assert token_loss(c, advantages=t([0.0]), **high)[1].clipped == 0.0
    assert token_loss(c, advantages=t([0.5]), **high)[1].clipped == 1.0


def test_stats_without_reference_entropy_or_tokens_are_zero():
    c = LossConfig(off_policy="tis", beta=0.0, entropy_coef=0.0, tis_cap=2.0)
    _loss, st = token_loss(c, logp=t([[0.0]]), behav_logp=t([[0.0]]), advantages=t([1.0]), mask=t([[1]]),
                           coef=t([[1.0]]))
    assert (st.kl_sum, st.entropy_sum) == (0.0, 0.0)
    empty = torch.zeros(1, 0, dtype=torch.float64)
    _loss, st = token_loss(c, logp=empty, behav_logp=empty, advantages=t([1.0]), mask=empty, coef=empty)
    assert st.is_weight_max == 0.0 and st.tokens == 0.0


def test_capped_tokens_are_counted_on_completion_tokens_only():
    c = LossConfig(off_policy="tis", beta=0.0, entropy_coef=0.0, tis_cap=2.0)
    # behaviour log-prob far below the current one: weight e^3 > cap on both tokens; the second is padding
    _loss, st = token_loss(c, logp=t([[0.0, 0.0]]), behav_logp=t([[-3.0, -3.0]]), advantages=t([1.0]),
                           mask=t([[1, 0]]), coef=t([[1.0, 1.0]]))
    assert st.is_capped == 1.0 and st.tokens == 1.0
