"""services.run_states: the states a run record can be in, and the moves between them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.run_states import LIVE_STATES, STATES, TERMINAL_STATES, TRANSITIONS, entered_from
from services.wire import RunRecord


def test_every_state_is_live_or_terminal_and_terminal_ones_are_never_left():
    assert LIVE_STATES | TERMINAL_STATES == set(STATES) and not LIVE_STATES & TERMINAL_STATES
    assert TERMINAL_STATES == {"finished", "stopped", "failed"}
    assert all(targets <= set(STATES) for targets in TRANSITIONS.values())
    assert not TERMINAL_STATES & set(TRANSITIONS)


def test_every_state_is_reachable_from_queued():
    seen, todo = {"queued"}, ["queued"]
    while todo:
        for nxt in TRANSITIONS.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(STATES)


def test_entered_from():
    assert entered_from("queued") == set()  # where every run starts
    assert entered_from("running") == {"queued", "running"}  # a restarted learner resumes its run
    assert entered_from("finished") == {"running"}  # a queued run never finishes
    assert entered_from("stopped") == entered_from("failed") == {"queued", "running"}


def test_the_run_record_takes_exactly_these_states():
    fields = dict(run_id="r", prompt_set_id="p", config={}, created_at=0.0)
    for state in STATES:
        assert RunRecord(state=state, **fields).state == state
    with pytest.raises(ValidationError):
        RunRecord(state="paused", **fields)
