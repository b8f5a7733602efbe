"""The GRPO objective against values worked out by hand (learner.loss).

Every expected number below is computed here from the equations in
``learner/loss.py``'s docstring with plain Python floats, independently of
the implementation; gradients are checked against the hand derivatives
d loss / d log pi_theta.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import (
    LossStats,
    aggregation_coefs,
    kl_estimate,
    token_entropy,
    token_logprobs,
    token_loss,
)
from services.config import LossConfig

ln = math.log


def cfg(**kw) -> LossConfig:
    base = dict(off_policy="none", beta=0.0, entropy_coef=0.0, eps_low=0.2, eps_high=0.28)
    base.update(kw)
    return LossConfig(**base)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def run(c: LossConfig, logp_rows, behav_rows, adv, mask_rows, coef_rows, **kw):
    logp = t(logp_rows).requires_grad_(True)
    loss, stats = token_loss(c, logp=logp, behav_logp=t(behav_rows), advantages=t(adv), mask=t(mask_rows),
                             coef=t(coef_rows), **kw)
    loss.backward()
    return loss.item(), logp.grad.flatten().tolist(), stats


# -- aggregation ---------------------------------------------------------------

def test_aggregation_coefficients():
    assert aggregation_coefs("token_mean", [1, 3], None) == pytest.approx([0.25, 0.25])
    assert aggregation_coefs("seq_mean_token_mean", [1, 3], None) == pytest.approx([0.5, 1 / 6])
    assert aggregation_coefs("token_sum_norm", [1, 3], 10) == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError):
        aggregation_coefs("token_sum_norm", [1], None)


# -- policy loss ---------------------------------------------------------------

def test_ppo_clip_against_behaviour_policy_values_and_gradients():
    # ratios: 0.5/0.4 = 1.25 (A=+1, inside 1.28: unclipped), 0.2/0.25 = 0.8 (A=+1: min picks 0.8, unclipped)
    #         0.4/0.4 = 1 (A=-1), last token masked out
    c = 1 / 3
    loss, grad, st = run(
        cfg(), [[ln(0.5), ln(0.2)], [ln(0.4), ln(0.9)]], [[ln(0.4), ln(0.25)], [ln(0.4), ln(0.5)]],
        [1.0, -1.0], [[1, 1], [1, 0]], [[c, c], [c, c]],
    )
    assert loss == pytest.approx(-(1.25 + 0.8 - 1.0) / 3)
    # d/dlogp of -c*A*r is -c*A*r when the unclipped branch is active
    assert grad == pytest.approx([-1.25 * c, -0.8 * c, 1.0 * c, 0.0])
    assert st.tokens == 3 and st.clipped == 0
    assert st.is_weight_sum == 3  # w = 1 without correction


def test_ppo_clip_higher_clips_each_side_separately():
    # r=1.5, A=+1: clipped at 1+0.28 -> -1.28, no gradient
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8 (clipped at 1-0.2), no gradient
    # r=0.5, A=+1: min(0.5, 0.8) = 0.5, unclipped: gradient -0.5
    # r=1.25, A=+1: inside [0.8, 1.28], gradient -1.25 (with eps_high=eps_low=0.2 it would clip)
    logp = [[ln(0.6), ln(0.2), ln(0.2), ln(0.5)]]
    behav = [[ln(0.4), ln(0.4), ln(0.4), ln(0.4)]]
    adv_per_token = [1.0, -1.0, 1.0, 1.0]
    # one row per token so each has its own advantage
    rows = [[lp] for lp in logp[0]]
    brow = [[b] for b in behav[0]]
    loss, grad, st = run(cfg(), rows, brow, adv_per_token, [[1]] * 4, [[1.0]] * 4)
    assert loss == pytest.approx(-1.28 + 0.8 - 0.5 - 1.25)
    assert grad == pytest.approx([0.0, 0.0, -0.5, -1.25])
    assert st.clipped == 2
    loss_sym, grad_sym, _ = run(cfg(eps_high=0.2), rows, brow, adv_per_token, [[1]] * 4, [[1.0]] * 4)
    assert loss_sym == pytest.approx(-1.2 + 0.8 - 0.5 - 1.2)
    assert grad_sym[3] == 0.0


def test_truncated_importance_sampling():
    # proximal = current (one step per batch): r = 1, w = min(pi/mu, C)
    # token 1: 0.5/0.1 = 5 -> capped at 2; token 2: 0.3/0.6 = 0.5
    loss, grad, st = run(
        cfg(off_policy="tis", tis_cap=2.0), [[ln(0.5), ln(0.3)]], [[ln(0.1), ln(0.6)]], [1.5], [[1, 1]], [[0.5, 0.5]]
    )
    assert loss == pytest.approx(-(2.0 * 1.5 + 0.5 * 1.5) * 0.5)
    assert grad == pytest.approx([-2.0 * 1.5 * 0.5, -0.5 * 1.5 * 0.5])  # d r / d logp = r = 1
    assert st.is_capped == 1 and st.is_weight_max == pytest.approx(2.0)
    assert st.is_weight_sum == pytest.approx(2.5)


def test_decoupled_ppo_uses_the_untruncated_behaviour_weight():
    loss, grad, st = run(
        cfg(off_policy="decoupled"), [[ln(0.5), ln(0.3)]], [[ln(0.1), ln(0.6)]], [-1.0], [[1, 1]], [[1.0, 1.0]]
    )
    assert loss == pytest.approx(5.0 + 0.5)
    assert grad == pytest.approx([5.0, 0.5])
    assert st.is_capped == 0 and st.is_weight_max == pytest.approx(5.0)


def test_gspo_sequence_ratio_values_and_gradients():
    # s = exp(mean(ln 1.25, ln 0.5)) = sqrt(0.625); A=+1; clip range [0.8, 1.28] -> unclipped (min picks s)
    s = math.sqrt(0.625)
    c = cfg(policy_loss="gspo", aggregation="seq_mean_token_mean")
    loss, grad, st = run(c, [[ln(0.5), ln(0.2)]], [[ln(0.4), ln(0.4)]], [1.0], [[1, 1]], [[0.5, 0.5]])
    assert loss == pytest.approx(-s)
    # GSPO gradient: -A * s * (1/|o|) per token
    assert grad == pytest.approx([-0.5 * s, -0.5 * s])
    # A = -1: min(-s, -0.8) = -0.8 is the clipped branch (s < 0.8): no gradient
    loss, grad, st = run(c, [[ln(0.5), ln(0.2)]], [[ln(0.4), ln(0.4)]], [-1.0], [[1, 1]], [[0.5, 0.5]])
    assert loss == pytest.approx(0.8)
    assert grad == pytest.approx([0.0, 0.0])
    assert st.clipped == 2


def test_gspo_sequence_ratio_ignores_padding():
    c = cfg(policy_loss="gspo")
    # padded position has a wild log-ratio that must not enter s
    loss, _grad, _ = run(c, [[ln(0.5), ln(0.9)]], [[ln(0.4), ln(0.01)]], [1.0], [[1, 0]], [[1.0, 1.0]])
    assert loss == pytest.approx(-1.25)


# -- KL and entropy --------------------------------------------------------------

def test_k1_and_k3_estimators():
    logp, ref = t([ln(0.5)]), t([ln(0.4)])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln(0.5 / 0.4))
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.8 - ln(0.8) - 1)


@pytest.mark.parametrize("kind,value,dlogp", [
    ("k1", ln(0.5 / 0.4), 1.0),  # d(logp - ref)/dlogp = 1
    ("k3", 0.8 - ln(0.8) - 1, 1 - 0.8),  # d(e^(ref-logp) - (ref-logp) - 1)/dlogp = 1 - e^(ref-logp)
])
def test_kl_penalty_in_the_loss(kind, value, dlogp):
    beta = 0.1
    c = cfg(beta=beta, kl_estimator=kind)
    # advantage 0: only the KL term remains
    loss, grad, st = run(c, [[ln(0.5)]], [[ln(0.5)]], [0.0], [[1]], [[1.0]], ref_logp=t([[ln(0.4)]]))
    assert loss == pytest.approx(beta * value)
    assert grad[0] == pytest.approx(beta * dlogp)
    assert st.kl_sum == pytest.approx(value)
    with pytest.raises(ValueError):
        token_loss(c, logp=t([[0.0]]), behav_logp=t([[0.0]]), advantages=t([0.0]), mask=t([[1]]), coef=t([[1.0]]))


def test_entropy_bonus():
    c = cfg(entropy_coef=0.01)
    h = t([[1.2, 0.7]]).requires_grad_(True)
    logp = t([[ln(0.5), ln(0.5)]]).requires_grad_(True)
    loss, st = token_loss(c, logp=logp, behav_logp=t([[ln(0.5), ln(0.5)]]), advantages=t([0.0]),
                          mask=t([[1, 1]]), coef=t([[0.5, 0.5]]), entropy=h)
    loss.backward()
    assert loss.item() == pytest.approx(-0.01 * (1.2 + 0.7) * 0.5)
    assert h.grad.tolist()[0] == pytest.approx([-0.005, -0.005])
    assert st.entropy_sum == pytest.approx(1.9)


def test_token_entropy_and_logprobs():
    logits = torch.zeros(1, 1, 4)
    assert token_entropy(logits).item() == pytest.approx(ln(4))
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]))
    assert token_logprobs(logits, torch.tensor([[2]])).item() == pytest.approx(ln(0.3), abs=1e-6)


def test_splitting_a_batch_sums_to_the_whole():
    """c fixed per batch: micro-batch losses add up to the full-batch loss (and gradients)."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
    behav = logp + torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).double()
    coef = torch.full((4, 5), 1 / float(mask.sum()), dtype=torch.float64)
    for c in (cfg(), cfg(off_policy="tis"), cfg(policy_loss="gspo")):
        whole, _ = token_loss(c, logp=logp, behav_logp=behav, advantages=adv, mask=mask, coef=coef)
        parts = sum(
            token_loss(c, logp=logp[i:j], behav_logp=behav[i:j], advantages=adv[i:j], mask=mask[i:j], coef=coef[i:j])[0]
            for i, j in ((0, 1), (1, 3), (3, 4))
        )
        assert parts.item() == pytest.approx(whole.item())


# -- edges that bench/mutation.py found untested (each test names what it guards) -----------------


FIELDS = ("tokens", "loss", "pg_loss", "kl_sum", "entropy_sum", "clipped", "is_weight_sum", "is_capped")


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
