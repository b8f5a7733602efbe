"""Learner settings: ``TANDEM_LEARNER_*`` on top of ``services.settings``."""

from __future__ import annotations

from pydantic import Field

from services.settings import WorkerSettings, settings_config


class LearnerSettings(WorkerSettings):
    """`tandem serve learner` (every rank of a multi-rank job): ``TANDEM_LEARNER_*``."""

    model_config = settings_config("TANDEM_LEARNER_")

    poll_s: float = Field(default=0.5, gt=0)
    """Without TANDEM_RUN_ID: how often the learner looks for the control plane's active run."""
