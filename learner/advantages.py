"""Group-relative advantages: one scalar per completion, from its group's rewards.

For a group of G completions of one prompt with rewards r_1..r_G:

- ``grpo`` (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300):
  A_i = (r_i - mean(r)) / (std(r) + eps), std the sample standard deviation
  (Bessel-corrected, as TRL's GRPOTrainer computes it).
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
  Critical Perspective", arXiv:2503.20783): A_i = r_i - mean(r); dividing by
  the std biases updates towards too-easy and too-hard prompts.
- ``rloo`` (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
  Style Optimization for Learning from Human Feedback in LLMs",
  arXiv:2402.14740): A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean(r)).

A group whose rewards are all equal carries no signal under any of the
three (every advantage is 0); DAPO's dynamic sampling (Yu et al. 2025,
arXiv:2503.14476) drops such groups so the batch is filled with groups that
do (``has_signal``).

Pure Python on purpose: this runs on the learner's data path before any
tensor exists, and the unit tests compare it with hand-computed numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6
"""Added to the std in GRPO so a near-constant group does not blow up."""

ZERO_VARIANCE_TOL = 1e-9
"""Rewards closer than this count as equal."""


def has_signal(rewards: Sequence[float]) -> bool:
    """False when every reward of the group is the same (zero variance)."""
    return max(rewards) - min(rewards) > ZERO_VARIANCE_TOL


def group_advantages(rewards: Sequence[float], kind: str) -> list[float]:
    """Advantages of one group's completions under ``kind`` (grpo | dr_grpo | rloo)."""
    g = len(rewards)
    if g == 0:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / g
    if kind == "dr_grpo":
        return [r - mean for r in rewards]
    if g < 2:
        # both need a second completion to compare with; one alone has no baseline
        raise ValueError(f"advantage {kind!r} needs groups of at least 2 completions")
    if kind == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))
        return [(r - mean) / (std + EPS) for r in rewards]
    if kind == "rloo":
        total = sum(rewards)
        return [r - (total - r) / (g - 1) for r in rewards]
    raise ValueError(f"unknown advantage estimator {kind!r}")
