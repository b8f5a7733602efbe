r"""The GRPO objective and its options (``[loss]`` in the run config).

A batch holds B completions o_i (of G-sized prompt groups), each with its
group-relative advantage A_i (``learner.advantages``), the behaviour
log-probabilities \mu(o_{i,t}) recorded by the rollout engine that sampled
it, and the current policy's log-probabilities \pi_\theta(o_{i,t}) from the
learner's forward pass (logits divided by the sampling temperature, so both
describe the same distribution). Every option below is a config field.

Token loss
----------
For token t of completion i, with ratio r_{i,t} = \pi_\theta / \pi_{old}:

    \ell^{pg}_{i,t} = - w_{i,t} \min( r_{i,t} A_i,
                                      clip(r_{i,t}, 1 - \epsilon_{low}, 1 + \epsilon_{high}) A_i )

- ``policy_loss = "ppo_clip"``: PPO's clipped surrogate (Schulman et al.
  2017) as used by GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300),
  with separate lower/upper ranges: ``eps_high > eps_low`` is DAPO's
  *clip-higher* (Yu et al. 2025, arXiv:2503.14476), which leaves
  low-probability tokens room to grow and so keeps entropy up.
- ``policy_loss = "gspo"``: GSPO (Zheng et al. 2025, "Group Sequence Policy
  Optimization", arXiv:2507.18071) clips one *sequence-level* ratio
  s_i = exp( (1/|o_i|) \sum_t (\log\pi_\theta - \log\pi_{old}) ), used per token
  as s_{i,t} = sg[s_i] \cdot \pi_\theta(o_{i,t}) / sg[\pi_\theta(o_{i,t})]
  (GSPO-token: same value and, with sequence-mean aggregation, same gradient
  as GSPO).

Off-policy correction (``off_policy``): which policy is "old" and the weight w
----------------------------------------------------------------------------
The learner trains each batch with exactly one optimizer step, so the
*proximal* policy of decoupled PPO (the weights at batch start) is the
current forward pass itself: \pi_{prox} = sg[\pi_\theta]. No extra forward
pass is needed.

- ``none``: \pi_{old} = \mu (the behaviour log-probs), w = 1. Plain PPO
  against the sampler: stale tokens that moved too far are clipped.
- ``tis``: truncated importance sampling (Ionides 2008; for LLM RL with a
  separate inference engine, Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", fengyao.notion.site):
  \pi_{old} = \pi_{prox}, w = min(\pi_{prox} / \mu, C) with C = ``tis_cap``.
  Corrects both staleness and sampler/trainer numeric mismatch with bounded
  variance.
- ``decoupled``: decoupled PPO (Hilton, Cobbe & Schulman 2022, "Batch Size-
  Invariance for Policy Optimization", arXiv:2110.00641; used by AReaL):
  \pi_{old} = \pi_{prox} and the untruncated behaviour weight
  w = \pi_{prox} / \mu. Unbiased; variance unbounded.

KL and entropy
--------------
With reference policy \pi_{ref} (frozen initial weights) and
\delta = \log\pi_{ref} - \log\pi_\theta (Schulman 2020, "Approximating KL
Divergence", joschu.net/blog/kl-approx.html):

- ``kl_estimator = "k1"``: k1 = -\delta = \log\pi_\theta - \log\pi_{ref}
- ``kl_estimator = "k3"``: k3 = e^{\delta} - \delta - 1 (unbiased, >= 0; GRPO's choice)

    \ell_{i,t} = \ell^{pg}_{i,t} + \beta\,KL_{i,t} - c_{H}\,H_{i,t}

with H_{i,t} = -\sum_v \pi_\theta(v) \log \pi_\theta(v) the entropy of the
token distribution and c_H = ``entropy_coef``.

Aggregation (``aggregation``): token losses become one number
--------------------------------------------------------------------------
    L = \sum_{i,t} c_{i,t} \ell_{i,t},   with c_{i,t}:

- ``token_mean`` (DAPO): c = 1 / \sum_i |o_i| (every token of the batch weighs the same);
- ``seq_mean_token_mean`` (GRPO paper): c_i = 1 / (B |o_i|);
- ``token_sum_norm`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783):
  c = 1 / N with a constant N (``norm_tokens``, default max_tokens x B), so
  long and short completions are not re-weighted by their length.

Because c is fixed per batch (computed before the batch is split), the loss
is a plain sum over micro-batches and data-parallel ranks: splitting a batch
any way gives the same gradient (the ZeRO/rank equivalence tests rely on it).

Overlong filtering (``drop_overlong``, DAPO): completions cut at
``max_tokens`` (``finish_reason == "length"``) are left out of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.config import LossConfig


def aggregation_coefs(kind: str, lengths: Sequence[int], norm_tokens: int | None) -> list[float]:
    """The per-sequence token weight c_i of ``kind`` for a batch of completion ``lengths``."""
    if not lengths or min(lengths) < 1:
        raise ValueError("every completion in a batch needs at least one token")
    if kind == "token_mean":
        total = sum(lengths)
        return [1.0 / total] * len(lengths)
    if kind == "seq_mean_token_mean":
        return [1.0 / (len(lengths) * n) for n in lengths]
    if kind == "token_sum_norm":
        if not norm_tokens:
            raise ValueError("token_sum_norm needs norm_tokens")
        return [1.0 / norm_tokens] * len(lengths)
    raise ValueError(f"unknown aggregation {kind!r}")


@dataclass
class LossStats:
    """Sums over the tokens of one micro-batch; :meth:`merge` adds micro-batches and ranks."""

    tokens: float = 0.0
    loss: float = 0.0
    pg_loss: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    clipped: float = 0.0
    is_weight_sum: float = 0.0
    is_weight_max: float = 0.0
    is_capped: float = 0.0
    extra: dict = field(default_factory=dict)

    def merge(self, other: LossStats) -> None:
        for name in ("tokens", "loss", "pg_loss", "kl_sum", "entropy_sum", "clipped", "is_weight_sum", "is_capped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.is_weight_max = max(self.is_weight_max, other.is_weight_max)

    def as_vector(self) -> list[float]:
        return [self.tokens, self.loss, self.pg_loss, self.kl_sum, self.entropy_sum, self.clipped,
                self.is_weight_sum, self.is_capped]

    @classmethod
    def from_vector(cls, v: Sequence[float], is_weight_max: float) -> LossStats:
        names = ("tokens", "loss", "pg_loss", "kl_sum", "entropy_sum", "clipped", "is_weight_sum", "is_capped")
        return cls(**dict(zip(names, (float(x) for x in v), strict=True)), is_weight_max=is_weight_max)

    def summary(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "loss": self.loss,
            "pg_loss": self.pg_loss,
            "kl": self.kl_sum / n,
            "entropy": self.entropy_sum / n,
            "clip_fraction": self.clipped / n,
            "is_weight_mean": self.is_weight_sum / n,
            "is_weight_max": self.is_weight_max,
            "is_capped_fraction": self.is_capped / n,
            "tokens": self.tokens,
        }


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    r"""Per-token KL(\pi_\theta || \pi_ref) estimate (k1 or k3), differentiable in ``logp``."""
    delta = ref_logp - logp
    if kind == "k1":
        return -delta
    if kind == "k3":
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}")


def token_loss(
    cfg: LossConfig,
    *,
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    coef: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The micro-batch's share of L and its statistics.

    All tensors are ``[B, T]`` (one row per completion, padded; ``mask`` is 1
    on completion tokens) except ``advantages`` (``[B]``). ``coef`` holds
    c_{i,t} (see the module docstring). ``ref_logp`` is needed when
    ``cfg.beta > 0``; ``entropy`` (the per-token entropy, differentiable when
    ``cfg.entropy_coef > 0``) is optional otherwise.
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    behav_logp = behav_logp.to(logp.dtype)

    if cfg.off_policy == "none":
        old_logp = behav_logp
        weight = torch.ones_like(logp)
        capped = torch.zeros_like(logp)
    else:
        old_logp = logp.detach()  # the proximal policy: the weights at batch start (one step per batch)
        raw = torch.exp(torch.clamp(old_logp - behav_logp, max=60.0))  # clamp: exp overflow, not a cap
        if cfg.off_policy == "tis":
            weight = torch.clamp(raw, max=cfg.tis_cap)
            capped = (raw > cfg.tis_cap).to(logp.dtype)
        elif cfg.off_policy == "decoupled":
            weight = raw
            capped = torch.zeros_like(logp)
        else:
            raise ValueError(f"unknown off_policy {cfg.off_policy!r}")

    log_ratio = logp - old_logp
    if cfg.policy_loss == "ppo_clip":
        ratio = torch.exp(log_ratio)
    elif cfg.policy_loss == "gspo":
        lengths = mask.sum(dim=1).clamp(min=1.0)
        seq_log_ratio = (log_ratio * mask).sum(dim=1) / lengths
        seq_ratio = torch.exp(seq_log_ratio).detach().unsqueeze(1)
        ratio = seq_ratio * torch.exp(logp - logp.detach())
    else:
        raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}")

    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, low, high) * adv
    pg = -weight * torch.minimum(surr1, surr2)
    per_token = pg
    kl = None
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        kl = kl_estimate(logp, ref_logp.to(logp.dtype), cfg.kl_estimator)
        per_token = per_token + cfg.beta * kl
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - cfg.entropy_coef * entropy

    w = coef.to(logp.dtype) * mask
    loss = (per_token * w).sum()

    with torch.no_grad():
        # a token is "clipped" when the clipped branch is the one the min picks and it has no gradient
        clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
        if kl is None and ref_logp is not None:
            kl = kl_estimate(logp, ref_logp.to(logp.dtype), cfg.kl_estimator)
        stats = LossStats(
            tokens=float(mask.sum()),
            loss=float(loss),
            pg_loss=float((pg * w).sum()),
            kl_sum=0.0 if kl is None else float((kl * mask).sum()),
            entropy_sum=0.0 if entropy is None else float((entropy * mask).sum()),
            clipped=float((clipped.to(logp.dtype) * mask).sum()),
            is_weight_sum=float((weight * mask).sum()),
            is_weight_max=float((weight * mask).max()) if mask.numel() else 0.0,
            is_capped=float((capped * mask).sum()),
        )
    return loss, stats


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution, ``[B, T, V] -> [B, T]`` (float32 softmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under ``logits``: ``[B, T, V], [B, T] -> [B, T]`` (float32 softmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
