"""deploy.trace: spans -> Chrome/Perfetto trace events (one process per service, one thread per track,
overlapping spans on lanes, nested ones kept on their parent's lane, incidents as instants), and
`tandem trace` on a run directory."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from deploy import trace
from deploy.cli import app
from services.timeline import Span, write_file
from services.wire import Incident


def _span(name, start, end, service="learner", track="rank0", **attrs):
    return Span(name, service, track, start, end, attrs)


def test_nested_spans_share_a_lane_and_overlapping_ones_do_not():
    spans = [_span("step", 0, 10), _span("forward", 1, 4), _span("backward", 4, 9), _span("publish", 10, 12),
             _span("x", 9.5, 11)]  # starts inside step, ends after it: a lane of its own
    assert trace.lanes(spans) == [0, 0, 0, 0, 1]
    groups = [_span("generate", 0, 5), _span("generate", 1, 6), _span("generate", 5, 8), _span("generate", 6, 7)]
    assert trace.lanes(groups) == [0, 1, 0, 1]


def test_trace_events_are_valid_and_complete():
    spans = [
        _span("read", 100.0, 101.0, step=1), _span("step", 101.0, 102.5, step=1),
        _span("generate", 100.2, 100.9, "rollout:r0", "groups", group="g1"),
        _span("generate", 100.5, 101.2, "rollout:r0", "groups", group="g2"),
        _span("stalled", 103.0, 105.0, "learner", "stalled", gap_s=2.0),
    ]
    inc = Incident(at=105.0, source="learner", what="learner heartbeat", on="its process", waited_s=2.0,
                   limit_s=1.0, field="watchdog.stall_s", action="recorded")
    out = json.loads(json.dumps(trace.trace_events(spans, [inc])))
    events = out["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == ["learner", "rollout:r0"] and names[1] == "learner"
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["groups #1", "groups #2", "rank0", "stalled"]
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == len(spans)
    for e in x:
        assert {"name", "pid", "tid", "ts", "dur", "args"} <= set(e) and e["ts"] >= 0 and e["dur"] >= 0
        assert threads[(e["pid"], e["tid"])]
    read = next(e for e in x if e["name"] == "read")
    assert read["ts"] == 0 and read["dur"] == 1e6 and read["args"] == {"step": 1}
    gens = [e for e in x if e["name"] == "generate"]
    assert gens[0]["tid"] != gens[1]["tid"], "overlapping groups go on two lanes"
    instants = [e for e in events if e["ph"] == "i"]
    assert len(instants) == 1 and instants[0]["pid"] == 1 and instants[0]["ts"] == 5e6


def test_the_stacks_cpu_account_is_a_counter_of_cores_per_service():
    spans = [_span("step", 100.0, 102.0),
             _span("cpu", 100.0, 105.0, "stack", "cpu", rollout=5.0, learner=2.5),
             _span("cpu", 105.0, 110.0, "stack", "cpu", rollout=2.5, learner=5.0)]
    events = trace.trace_events(spans)["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == ["step"]  # the account is no span
    counters = [e for e in events if e["ph"] == "C"]
    assert [(e["ts"], e["args"]) for e in counters] == [(0, {"learner": 0.5, "rollout": 1.0}),
                                                       (5e6, {"learner": 1.0, "rollout": 0.5})]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[counters[0]["pid"]] == "stack"


def test_tandem_trace_on_a_run_directory(tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    write_file(run / "timeline.jsonl", [_span("read", 1.0, 2.0), _span("step", 2.0, 3.0)])
    (run / "summary.json").write_text(json.dumps({"incidents": []}))
    out = tmp_path / "t.json"
    result = CliRunner().invoke(app, ["trace", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 spans" in result.output
    assert [e["name"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"] == ["read", "step"]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(app, ["trace", str(empty), "--run-dir", str(tmp_path / "nostack")])
    assert result.exit_code != 0
