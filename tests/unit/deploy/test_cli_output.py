"""The CLI off a terminal (a log, a pipe, CI): progress and ``tandem status`` in full lines, a malformed
setting in one line, and where the local stack's directory is (``deploy.client``)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from typer.testing import CliRunner

from deploy import client
from deploy.cli import app
from services import wire

ROOT = Path(__file__).resolve().parents[3]
NOTE = "reward 0.52  lag<=1  dropped 3  eval mean@4 67.2%, pass@4 80.0% (v7)"


def test_progress_into_a_pipe_is_full_lines_every_ten_steps_each_eval_and_the_last():
    """Before: rich drew its bar into the pipe at 80 columns, ``training ━━━━ 150… 0:0…``."""
    code = ("from deploy.progress import progress_bar\n"
            "with progress_bar('training', total=25) as update:\n"
            f"    for step in range(1, 26):\n        update(step, {NOTE!r}, mark=step == 7)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=60,
                         check=True, env={**os.environ, "COLUMNS": "80"}).stdout
    assert out.splitlines() == [f"training: {n}/25  {NOTE}" for n in (1, 7, 17, 25)]


def _status() -> wire.RunStatus:
    point = wire.EvalPoint(version=20, accuracy=0.672, count=200, by="rollout", samples=4,
                           pass_at={1: 0.672, 2: 0.75, 4: 0.8})
    return wire.RunStatus(
        run=wire.RunRecord(run_id="r", state="running", prompt_set_id="ps-x", config={}, created_at=0.0,
                           step=23, policy_version=23),
        reward_mean=0.5, accuracy=0.672, accuracy_first=0.62, eval=point, weights_version=23,
        staleness=wire.Staleness(max_staleness=1, max_observed_lag=1.0, stale_dropped=0, queued=0, in_flight=0,
                                 backlog=0),
        throughput=wire.Throughput(rollout_tokens_per_s=None, learner_tokens_per_s=None, rollout_idle_frac=None,
                                   learner_idle_frac=None),
        counters={},
    )


def test_status_off_a_terminal_is_not_cut(monkeypatch):
    """Before: ``mean@4 67.2%, pass@1 67.2%, pass@2`` and nothing after (rich's 80 columns)."""
    class Control:
        async def run_status(self, run_id):
            return _status()

    @asynccontextmanager
    async def control(url, run_dir=None):
        yield Control()

    monkeypatch.setattr("deploy.cli.control", control)
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(app, ["status", "r"])  # its output is not a terminal
    assert result.exit_code == 0, result.output
    assert "mean@4 67.2%, pass@1 67.2%, pass@2 75.0%, pass@4 80.0% (version 20)" in result.output
    assert "…" not in result.output


def test_a_malformed_setting_is_one_line_naming_the_variable():
    """Before: a pydantic_settings SettingsError traceback ('error parsing value for field "functions"')."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {"TANDEM_REWARD_FUNCTIONS": "mod:*"}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "reward"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["TANDEM_REWARD_FUNCTIONS: expected a JSON list, e.g. '[\"mod:*\"]'"]


def test_the_stack_directory_is_the_flag_else_tandem_run_dir_else_runs_stack(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_RUN_DIR", raising=False)
    assert client.stack_dir() == Path("runs/stack") and client.runs_dir() == Path("runs")
    monkeypatch.setenv("TANDEM_RUN_DIR", str(tmp_path))
    assert client.stack_dir() == tmp_path and client.runs_dir() == tmp_path
    assert client.stack_dir(tmp_path / "flag") == tmp_path / "flag"
    assert client.runs_dir(tmp_path / "flag") == tmp_path / "flag"
