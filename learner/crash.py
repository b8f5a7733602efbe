"""A test-only hook that kills the learner inside a chosen window of a step.

Off unless :data:`CRASH_AT` is set (never in normal use): ``learner.trainer``,
``learner.checkpoints`` and ``learner.engine.LearnerEngine.save`` call :func:`crash_point` at the points a kill -9 from
outside would hit only by chance (``tests/integration/deploy/test_main_job.py`` sets it).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger("tandem.learner")

CRASH_AT = "_TANDEM_CRASH_AT"
"""Tests only, unset in normal use: ``POINT:STEP,...`` (:func:`crash_point`)."""


def crash_point(point: str, step: int, marker_dir: Path) -> None:
    """SIGKILL this process at ``point`` of ``step`` if :data:`CRASH_AT` names ``point:step``, once per
    run (the marker file ``marker_dir/crashed-POINT-STEP`` says it happened). Off unless set: it lets a
    test kill the learner inside a window that a kill -9 from outside hits only by chance
    (tests/integration/deploy/test_main_job.py)."""
    if f"{point}:{step}" not in os.environ.get(CRASH_AT, "").split(","):
        return
    marker = Path(marker_dir) / f"crashed-{point}-{step}"
    if marker.exists():
        return
    marker.touch()
    log.warning("%s=%s: killing the learner at %s of step %d", CRASH_AT, os.environ[CRASH_AT], point, step)
    os.kill(os.getpid(), signal.SIGKILL)
