"""TRL 1.16's own reward functions (``trl.rewards``), built as TRL's documentation builds them, for the
reward servers of the actor tests: the functions a run scores
with, to compare with TRL's own call on the same completions. Allowed by name: a pattern allows only
the functions a module defines itself, and ``overlong`` is defined by TRL."""

from __future__ import annotations

import asyncio

from trl.rewards import get_soft_overlong_punishment

overlong = get_soft_overlong_punishment(max_completion_len=14, soft_punish_cache=6)
"""DAPO's soft overlong punishment: reads ``completion_ids``."""


async def schedule(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    """Shaped by training progress, as TRL's documentation suggests, logging a metric and a column."""
    await asyncio.sleep(0.01)
    log_metric("schedule/progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("tokens", [len(ids) for ids in completion_ids])
    return [len(ids) * (1 + trainer_state.global_step) / trainer_state.max_steps + trainer_state.epoch
            for ids in completion_ids]
