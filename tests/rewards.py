"""Python reward functions the test suite's reward servers allow (``functions=["tests.rewards:*"]``), in
TRL's shape; the reward server's spawned workers import this module from the repository."""

from __future__ import annotations

import json


def failing(prompts, completions, **kwargs):
    """Always raises: a ``reward_error`` for every completion, the infrastructure failure actor tests need."""
    raise RuntimeError("this reward function always fails")


def even_length(prompts, completions, log=None, **kwargs):
    """1 for a completion of even length, else 0; with ``log`` (a path, from the spec's ``args``) each
    ``{"prompt", "completion", "reward"}`` is appended to that file, so a test can recompute what the
    reward server was given."""
    rewards = [float(len(c) % 2 == 0) for c in completions]
    if log:
        with open(log, "a") as out:
            for p, c, r in zip(prompts, completions, rewards, strict=True):
                out.write(json.dumps({"prompt": p, "completion": c, "reward": r}) + "\n")
    return rewards
