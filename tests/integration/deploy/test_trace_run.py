"""The timeline of a real run against its ledger, and ``tandem trace`` on it (issue 27, item 1).

- A short ``tandem run`` of the example (4 steps, real vLLM, DeepSpeed, reward
  sandboxes): every trained group has its ``generate`` span, inside the window
  between its ``admitted`` and ``generated`` ledger entries; every step has its
  ``read`` and ``step`` spans with ``forward``/``backward``/``optimizer`` inside
  and every version its ``publish``; no sequential track holds two overlapping
  spans of one kind, and a group's generate -> score -> handoff follow each
  other; ``tandem trace`` of the run directory parses as trace-event JSON whose
  lanes nest properly; ``summary.json`` lists the run's incidents.
- ``tandem trace RUN_ID`` reads a live run's spans from Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.ledger import read_file as read_ledger
from deploy.audit import find_ledger
from deploy.cli import app
from services.config import load_run_config
from services.timeline import Timeline, breakdown, read_file
from tests.fixtures.stack import short_run_config

ROOT = Path(__file__).resolve().parents[3]
STEPS = 4
SEQUENTIAL = {"read", "step", "forward", "backward", "optimizer", "publish", "checkpoint", "admit", "reload",
              "eval_hold"}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_runs_spans_agree_with_its_ledger_and_make_a_trace(tmp_path, arith_model):
    config_path = short_run_config(tmp_path, arith_model, steps=STEPS, checkpoint_every=2, eval_prompts=8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", str(config_path), "--runs", str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    spans = read_file(run_dir / "timeline.jsonl")
    ledger = read_ledger(find_ledger(run_dir))
    assert spans and ledger

    # every trained group was generated, in the window the ledger gives it (ledger times are whole ms)
    trained = {e["g"] for e in ledger if e["e"] == "trained"}
    assert len(trained) == STEPS * load_run_config(config_path).learner.groups_per_step
    admitted: dict[str, float] = {}
    for e in ledger:
        if e["e"] == "admitted":
            admitted.setdefault(e["g"], e["t"] / 1000)
    generated = {e["g"]: e["t"] / 1000 for e in ledger if e["e"] == "generated"}
    by_group = defaultdict(list)
    for s in spans:
        if s.track == "groups":
            by_group[s.attrs["group"]].append(s)
    for g in trained:
        gen = [s for s in by_group[g] if s.name == "generate" and "error" not in s.attrs]
        assert gen, f"trained group {g} has no generate span"
        assert admitted[g] - 0.01 <= gen[-1].start <= gen[-1].end <= generated[g] + 0.01, (g, gen, admitted[g])
        names = [s.name for s in sorted(by_group[g], key=lambda s: s.start) if s.start >= gen[-1].start]
        assert names == ["generate", "score", "handoff"], names
        order = sorted(by_group[g], key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(order, order[1:], strict=False)), order

    # the learner's steps and versions
    learner = [s for s in spans if s.service == "learner"]
    steps = {s.attrs["step"] for s in learner if s.name == "step"}
    assert steps == set(range(1, STEPS + 1)), steps
    assert {s.attrs["step"] for s in learner if s.name == "read"} >= steps
    assert {s.attrs["version"] for s in learner if s.name == "publish"} == set(range(1, STEPS + 1))
    for step in (s for s in learner if s.name == "step"):
        inside = [s for s in learner if s.name in ("forward", "backward", "optimizer")
                  and step.start <= s.start and s.end <= step.end]
        assert {s.name for s in inside} == {"forward", "backward", "optimizer"}, step

    # nothing overlaps impossibly: one kind on one sequential track at a time
    tracks = defaultdict(list)
    for s in spans:
        if s.name in SEQUENTIAL:
            tracks[(s.service, s.track, s.name)].append(s)
    for key, group in tracks.items():
        group.sort(key=lambda s: s.start)
        for a, b in zip(group, group[1:], strict=False):
            assert a.end <= b.start + 1e-6, (key, a, b)
    assert {s.service for s in spans} >= {"learner"} and any(s.service.startswith("rollout:") for s in spans)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert isinstance(summary["incidents"], list)

    out = tmp_path / "trace.json"
    traced = subprocess.run([sys.executable, "-m", "deploy.cli", "trace", str(run_dir), "-o", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert traced.returncode == 0, traced.stderr
    events = json.loads(out.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    cpu = [s for s in spans if s.name == "cpu" and s.track == "cpu"]
    assert cpu, "the stack wrote no CPU account spans"
    assert len(complete) == len(spans) - len(cpu)  # the CPU account is drawn as a counter
    assert len([e for e in events if e["ph"] == "C" and e["name"] == "CPU cores"]) == len(cpu)
    lanes = defaultdict(list)
    for e in complete:
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lane in lanes.values():  # on a lane, spans nest or follow each other
        open_ends: list[float] = []
        for start, end in sorted(lane, key=lambda x: (x[0], -x[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 0.2, "partly overlapping spans on one lane"
            open_ends.append(end)
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"rank0", "admit"} <= threads and any(t.startswith("groups") for t in threads)
    rows = breakdown(spans)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    mean = {side: {k: sum(r[side][k] for r in rows[1:]) / (len(rows) - 1) for k in rows[0][side]}
            for side in ("learner", "rollout")}
    print(f"{len(spans)} spans over {STEPS} steps; steps 2-{STEPS}, mean seconds: "
          + "; ".join(f"{side} " + ", ".join(f"{k} {v:.2f}" for k, v in m.items() if v >= 0.005)
                      for side, m in mean.items()))


def test_tandem_trace_reads_a_live_run_from_redis(redis_url, keys, tmp_path, monkeypatch):
    tl = Timeline(redis_url, keys, "learner")
    tl.add("read", 1.0, 2.0, "rank0", step=1)
    tl.add("generate", 1.5, 2.5, "groups", group="g0")
    tl.flush()
    monkeypatch.setenv("REDIS_URL", redis_url)
    out = tmp_path / "live.json"
    result = CliRunner().invoke(app, ["trace", keys.run_id, "-o", str(out), "--run-dir", str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    assert sorted(e["name"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X") == ["generate", "read"]
    unknown = CliRunner().invoke(app, ["trace", "no-such-run", "--run-dir", str(tmp_path / "none")])
    assert unknown.exit_code == 1 and "no spans" in unknown.output
