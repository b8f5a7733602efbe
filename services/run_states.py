"""A run's states and the moves between them, in one place.

::

    queued --> running --> finished | stopped | failed
    queued --> stopped | failed
    running --> running            (a restarted learner resumes its run)

Who uses what: :data:`RunState` is the type of ``services.wire.RunRecord.state`` (the wire module
imports it from here); ``services.runs.RunStore.set_state`` moves a run only along
:data:`TRANSITIONS`, checked inside its Redis script, so two services racing to move one run
cannot skip a state; services follow a run while it is in :data:`LIVE_STATES` (one live run per
stack); clients (``tandem run`` / ``status``, the main job, the control plane's trackers) wait for
:data:`TERMINAL_STATES`, which no transition leaves.

The states live beside their transitions rather than in ``services.wire`` so that adding a state
means editing one table here; the wire type follows by import. Light module: no Redis, no pydantic.
"""

from __future__ import annotations

from typing import Literal, get_args

RunState = Literal["queued", "running", "finished", "stopped", "failed"]
"""Every state a run record can be in."""
STATES: tuple[str, ...] = get_args(RunState)

TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "stopped", "failed"}),
    # running -> running: a restarted learner resumes its run
    "running": frozenset({"running", "finished", "stopped", "failed"}),
}
"""State -> the states a run in it may move to. A state that is no key here is terminal."""

LIVE_STATES = frozenset(TRANSITIONS)
"""The states of an active run: services work on it, and no other run may start."""
TERMINAL_STATES = frozenset(STATES) - LIVE_STATES
"""The states a run ends in (``finished``, ``stopped``, ``failed``): nothing moves it on."""


def entered_from(state: str) -> frozenset[str]:
    """The states a run may move to ``state`` from (empty for ``queued``, where every run starts)."""
    return frozenset(source for source, targets in TRANSITIONS.items() if state in targets)
