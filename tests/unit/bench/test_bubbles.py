"""bench/bubbles.py: the steady state's busy and idle split, from a hand-made timeline and from a trace file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.bubbles import bubbles, load  # noqa: E402
from deploy.trace import trace_events  # noqa: E402
from services.timeline import Span, write_file  # noqa: E402

R = "rollout:r0"


def _timeline() -> list[Span]:
    """Four learner steps of 2 s (read 0.5 s, step 1.5 s); the rollout server generates for the first second
    of each, then waits: full, a reload, a stale refusal, scoring."""
    spans = []
    for k in range(4):
        t = 2.0 * k
        spans += [Span("read", "learner", "rank0", t, t + 0.5, {"step": k + 1}),
                  Span("step", "learner", "rank0", t + 0.5, t + 2.0, {"step": k + 1}),
                  Span("generate", R, "groups", t, t + 0.8, {"group": f"a{k}"}),
                  Span("generate", R, "groups", t + 0.2, t + 1.0, {"group": f"b{k}"}),  # overlaps: counted once
                  Span("score", R, "groups", t + 0.9, t + 1.1, {"group": f"b{k}"}),  # under generate until 1.0
                  Span("admit", R, "admit", t + 1.1, t + 1.6, {"reason": "admitted"}),  # waited for room
                  Span("reload", R, "weights", t + 1.6, t + 1.7, {"version": k}),
                  Span("admit", R, "admit", t + 1.7, t + 1.8, {"reason": "stale"})]
    return spans


def test_the_split_by_reason():
    b = bubbles(_timeline(), skip=0.25)  # step 1 left out: steps 2..4, from t = 2 to t = 8
    assert b["steps"] == [2, 4] and b["wall_s"] == pytest.approx(6.0)
    r = b["rollout"]
    assert r["alive_s"] == pytest.approx(5.8)  # a server counts from its first span to its last (t = 7.8)
    secs = r["by_reason_s"]
    per_step = {"generate": 1.0, "score": 0.1, "full": 0.5, "reload": 0.1, "stale": 0.1, "other": 0.2}
    for kind, s in per_step.items():
        assert secs[kind] == pytest.approx(3 * s - (0.2 if kind == "other" else 0.0)), kind
    assert r["busy"] == pytest.approx(3.0 / 5.8)
    # two groups for 0.6 s of each second of generation, one for the other 0.4
    assert r["mean_groups_generating"] == pytest.approx(3 * (0.6 * 2 + 0.4) / 5.8)
    ln = b["learner"]
    assert ln["data_wait_s"] == pytest.approx(1.5) and ln["busy"] == pytest.approx(0.75)
    assert ln["both_idle_s"] == pytest.approx(0.0)  # the learner read while the server generated


def test_a_trace_file_and_a_timeline_file_give_the_same_figures(tmp_path):
    spans = _timeline()
    write_file(tmp_path / "timeline.jsonl", spans)
    (tmp_path / "trace.json").write_text(json.dumps(trace_events(spans)))
    from_dir, from_trace = bubbles(load(tmp_path)), bubbles(load(tmp_path / "trace.json"))
    assert from_trace["rollout"]["by_reason_s"] == pytest.approx(from_dir["rollout"]["by_reason_s"], abs=1e-5)
    assert from_trace["learner"]["busy"] == pytest.approx(from_dir["learner"]["busy"], abs=1e-6)
