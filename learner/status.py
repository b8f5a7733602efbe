"""What the learner reports: ``GET /v1/status`` (:class:`Status`) and each publish (:class:`Published`).

The training thread writes a :class:`Status` (assignments are validated, so
a wrong type fails where it is written); the HTTP thread serves it as the
route's response model. Light module: no torch.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LearnerState = Literal["idle", "starting", "waiting", "training", "checkpointing", "done", "failed", "stopped"]
"""``idle``: no run to train (stack mode, between runs); ``starting``: loading the model and the
checkpoint; ``waiting``: for trajectory groups; ``training``: a step is running; ``checkpointing``:
saving one (its groups are acknowledged after it); ``done``: the last step
is taken; ``failed``: see ``error``; ``stopped``: on request (SIGTERM, or the run stopped) before the end."""


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Published(_Report):
    """One published weight version (a line of ``published.jsonl``, and ``Status.last_publish``)."""

    version: int = Field(ge=1)
    step: int = Field(ge=0)
    """The optimizer step whose weights these are."""
    bytes: int = Field(ge=0)
    gather_s: float
    """Gathering the full weights (collective; ZeRO-3 parameters module by module)."""
    write_s: float
    """Writing the version directory (files, checksum, atomic rename)."""
    total_s: float
    """Gather + write + register in the broker."""
    write_gb_per_s: float
    resume: bool
    """Published at start-up because the registry was ahead of the checkpoint (``learner.trainer``)."""
    broadcast_s: float | None = None
    """With ``publish.transport = "broadcast"``: streaming the version to the servers in its group, before
    the write (None: no member, or files only)."""
    blocked_s: float | None = None
    """What the publish cost the learner's loop: ``total_s`` for files; gather + broadcast with
    ``transport = "broadcast"``, whose files are written in the background meanwhile."""
    broadcast_to: int = 0
    """Rollout servers that received the version in memory (0 when the broadcast failed or had no member)."""


class Status(_Report):
    """``GET /v1/status``: the learner's progress on its run."""

    run_id: str | None = None
    """The run being trained (None while a stack-mode learner waits for one)."""
    state: LearnerState = "starting"
    step: int = 0
    """Optimizer steps taken (after a resume: counting those of the checkpoint)."""
    steps: int = 0
    """``learner.steps`` of the run: the step at which it is done."""
    version: int = 0
    """v_learner: the newest version published (the checkpoint's after a resume, until the next publish)."""
    rank_count: int = 1
    error: str | None = None
    last: dict[str, float | None] = Field(default_factory=dict)
    """The latest step's statistics (loss, kl, entropy, ..., train_s, groups, sequences); None where
    DeepSpeed keeps none (``grad_norm`` without ZeRO)."""
    counts: dict[str, int] = Field(default_factory=dict)
    """Groups not trained, by reason, and dead letters (this process)."""
    tokens_per_s: float = 0.0
    """Tokens trained per second of the latest step."""
    idle_fraction: float = 0.0
    """Fraction of wall time since the first step spent waiting for trajectories."""
    last_publish: Published | None = None
    resumed_from: int | None = None
    """The checkpoint's step if the run resumed from one."""
    lost_steps: int = 0
    """Steps trained after the checkpoint a resume restored (retrained from their groups)."""
    retracted: list[int] = Field(default_factory=list)
    """Versions withdrawn at a resume (published after the checkpoint it restored)."""
    last_checkpoint_s: float | None = None
    """How long the latest checkpoint save took (training waits for it)."""
    started_at: float = Field(default_factory=time.time)
