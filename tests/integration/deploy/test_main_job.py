"""``tandem run`` (``make run``), the main job, as a user runs it: exit code, summary.json, report.

- A short run of the example (9 steps, a checkpoint every 3, 16 held-out
  prompts) on the real stack (embedded Redis, reward sandboxes, vLLM,
  DeepSpeed). The learner kills itself (SIGKILL, ``_TANDEM_CRASH_AT``:
  :func:`learner.crash.crash_point`) in the three windows that a kill -9
  from outside hits only by chance: after publishing step 6's version but
  before its checkpoint and acknowledgement; in the middle of step 9's
  checkpoint (files written, pointer not replaced); after step 9's checkpoint
  but before its groups are acknowledged. The supervisor restarts it each
  time; the run must still exit 0 with an audit that passes (no group lost or
  trained twice, versions contiguous, the resumes' retractions recorded) and a
  summary.json whose figures agree with the ledger.
- Runs that must fail: a config with a bad field (exit 2 naming the field,
  before anything starts) and a service that cannot start (exit 1 naming it
  and its log, no process left behind).
- A run stopped by SIGTERM while it trains (what a job scheduler or ``docker
  stop`` sends): exit 130, no process left behind, its run directory kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.processes import OWNER_VARIABLE
from services.config import load_run_config
from services.runs import CHARTS
from tests.fixtures.stack import short_run_config

ROOT = Path(__file__).resolve().parents[3]
STEPS, CHECKPOINT_EVERY, EVAL_PROMPTS = 9, 3, 16
CRASHES = ("published:6", "saving:9", "saved:9")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    return env | extra


def _tandem_run(config: Path, runs: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "run", str(config), "--runs", str(runs)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def _owned_by_pid(pid: int) -> list[int]:
    """Live processes a stack started by process ``pid`` left (its tag is ``PID-...``, below the session's)."""
    variable, mine = f"{OWNER_VARIABLE}=".encode(), f"{pid}-".encode()

    def stack_tag(value: bytes) -> bool:
        return value.startswith(variable) and any(s.startswith(mine) for s in value[len(variable):].split(b"/"))

    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(stack_tag(v) for v in (entry / "environ").read_bytes().split(b"\0")):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return left


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tandem_run_writes_summary_and_report_and_survives_learner_kills_in_its_windows(tmp_path, arith_model):
    config_path = short_run_config(tmp_path, arith_model, steps=STEPS, checkpoint_every=CHECKPOINT_EVERY,
                                   eval_prompts=EVAL_PROMPTS)
    with open(config_path, "a") as f:  # the control plane logs the run to TensorBoard (docs/trackers.md)
        f.write('\n[logging]\ntrackers = ["tensorboard"]\n')
    config = load_run_config(config_path)
    runs = tmp_path / "runs"
    t0 = time.monotonic()
    # back-off 0.5 s, 1 s, 2 s before the three restarts (the default's 2, 4, 8 s would only be waited out)
    done = _tandem_run(config_path, runs, _env(_TANDEM_CRASH_AT=",".join(CRASHES), TANDEM_STACK_MAX_RESTARTS="5",
                                               TANDEM_STACK_RESTART_BACKOFF_S="0.5"), timeout_s=1100)
    wall = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    assert run_dir.parent == runs.resolve() and [p.name for p in runs.iterdir()] == [run_dir.name]
    learner_files = run_dir / run_dir.name
    # each crash happened, once, at its point (the marker files), and the learner was restarted each time
    assert sorted(p.name for p in (learner_files / "checkpoints").glob("crashed-*")) == sorted(
        f"crashed-{c.replace(':', '-')}" for c in CRASHES)
    assert done.stdout.count("learner exited with code -9") == len(CRASHES), done.stdout[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    audit = summary["audit"]
    assert audit["ok"] and audit["violations"] == 0, audit
    assert (audit["lost"], audit["trained_twice"], audit["groups"]["open"]) == (0, 0, 0), audit
    assert audit["learner_starts"] == 1 + len(CRASHES)
    assert audit["closed"] == "run_finished" and audit["steps"] == STEPS
    # the kill after step 6's publish loses steps 4-6 (checkpoint 3), the kill mid-checkpoint 9 loses 7-9
    # (checkpoint 6): their 6 versions are retracted; the kill after checkpoint 9 loses none (its groups
    # are acknowledged at the resume)
    assert len(audit["versions"]["retracted"]) == 6 and audit["lost_steps"] == 6, audit

    assert summary["run_id"] == run_dir.name and summary["config"] == str(config_path)
    assert summary["steps"] == STEPS
    assert summary["final_version"] == audit["versions"]["last"] == STEPS + 2 * 3 + 2  # 6 retracted, 2 republished
    assert summary["groups_trained"] == audit["groups"]["trained"] == STEPS * config.learner.groups_per_step
    assert summary["samples"] == summary["counters"]["produced"] * config.sampling.group_size > 0
    assert summary["eval_prompts"] == EVAL_PROMPTS
    evals = {e["version"]: e["accuracy"] for e in summary["evals"]}
    assert evals[0] == summary["accuracy_before"] and evals[summary["final_version"]] == summary["accuracy_after"]
    assert summary["accuracy_after"] > summary["accuracy_before"], summary  # 37.5% -> 93.8% when measured
    assert summary["max_staleness"] == 1 and 0 <= summary["max_observed_lag"] <= 1
    assert summary["stale_dropped"] == summary["counters"].get("stale_dropped", 0)
    assert 0 < summary["wall_s"] <= wall
    t = summary["throughput"]  # the run's means, not the last sample (taken once the rollout side idled)
    assert t["rollout_tokens_per_s"] > 0 and t["learner_tokens_per_s"] > 0 and t["rollout_idle_frac"] < 1, t
    # the CPU account (deploy.cpu_account): every process of every service, per trained sample; the
    # rollout server's vLLM engine core apart from its service process
    cpu = summary["cpu"]
    assert cpu["samples_trained"] == summary["groups_trained"] * config.sampling.group_size
    assert set(cpu["services"]) == {"reward", "control", "rollout", "learner", "redis", "stack"}, cpu
    for name, c in cpu["services"].items():
        assert c["cpu_s"] > 0 and c["per_sample_s"] == pytest.approx(c["cpu_s"] / cpu["samples_trained"]), (name, c)
        assert sum(c["processes"].values()) == pytest.approx(c["cpu_s"], abs=0.01), (name, c)
    assert cpu["per_sample_s"] == pytest.approx(sum(c["cpu_s"] for c in cpu["services"].values())
                                                / cpu["samples_trained"])
    assert {"VLLM::EngineCor", "python"} <= set(cpu["services"]["rollout"]["processes"]), cpu
    assert "CPU-seconds per trained sample: " in done.stdout

    report = run_dir / "report"
    assert sorted(p.name for p in report.iterdir()) == sorted(f"{c}.png" for c in CHARTS)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report.iterdir())
    # TensorBoard: every step the learner reported (a step whose report a kill prevented, here step 9 after
    # its checkpoint, is in neither trained.jsonl nor the metrics) and every held-out evaluation, the final
    # one too (it came after the learner finished: the trackers stayed open until the stack stopped)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(learner_files / "trackers" / "tensorboard" / run_dir.name), {"scalars": 0})
    events.Reload()
    reported = {json.loads(x)["step"] for x in (learner_files / "learner" / "trained.jsonl").read_text().splitlines()}
    assert {e.step for e in events.Scalars("train/loss")} == reported and len(reported) >= STEPS - 1
    assert sorted(e.step for e in events.Scalars("eval/accuracy")) == sorted(evals)
    assert (learner_files / "trackers" / f"{run_dir.name}.closed").read_text().strip() == "finished"
    # the completions table: logging.completions (4) trained samples of every step reported (a step trained
    # again after a kill is reported again), each with its prompt, completion, reward and advantage
    rows = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == reported and len(rows) >= 4 * len(reported), len(rows)
    assert all(r["prompt"].endswith("=") and r["completion"] and r["reward"] in (0.0, 1.0) for r in rows), rows[:4]
    # the best kept version (the final one: version 0 is the base model, never on disk) as a Hugging Face folder
    out = tmp_path / "exported"
    exported = subprocess.run([sys.executable, "-m", "deploy.cli", "export", str(run_dir), str(out), "--version",
                               "best"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((out / "tandem-export.json").read_text())["version"] == summary["final_version"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == config_vocab(arith_model)
    print(f"tandem run of {STEPS} steps with {len(CRASHES)} learner kills: {wall:.0f} s; "
          f"accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")


def config_vocab(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def test_a_bad_config_fails_naming_the_field_before_anything_starts(tmp_path):
    config_path = short_run_config(tmp_path, tmp_path / "model", steps=2, checkpoint_every=1)
    config_path.write_text(config_path.read_text().replace("groups_per_step = ", "groups_per_stp = "))
    done = _tandem_run(config_path, tmp_path / "runs", _env(), timeout_s=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "learner.groups_per_stp: unknown field" in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()  # no stack directory: nothing was started


@pytest.mark.slow  # it starts vLLM and DeepSpeed (and stops them while they start)
def test_a_service_that_cannot_start_fails_the_run_and_leaves_no_process(tmp_path, arith_model):
    config_path = short_run_config(tmp_path, arith_model, steps=2, checkpoint_every=1)
    # the control plane refuses its own settings and exits while vLLM and DeepSpeed are still starting
    env = _env(TANDEM_CONTROL_MAX_PROMPT_SET_LINES="0", TANDEM_STACK_STOP_GRACE_S="2")
    job = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(config_path), "--runs",
                            str(tmp_path / "runs")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 1, out + err
    stack = next((tmp_path / "runs").glob(".stack-*"))
    assert f"tandem run failed: control exited with code 2 while starting; see {stack}/logs/control.log" in \
        " ".join(err.split()), err
    assert "max_prompt_set_lines" in (stack / "logs" / "control.log").read_text()
    assert not _owned_by_pid(job.pid), "a process the stack started is still alive"


@pytest.mark.long
@pytest.mark.slow
def test_a_reward_that_always_fails_ends_the_run_with_its_error_at_once(tmp_path, arith_model):
    """Every line's reward is a python function that raises (issue: all groups dropped within a second, then
    `training 0/5 ... dropped 0` for minutes): the run fails after reward.fail_after groups, and tandem run
    says why in one line, with the function's error; summary.json and the incident say it too."""
    config_path = short_run_config(tmp_path, arith_model, steps=5, checkpoint_every=5)
    config = load_run_config(config_path)
    train = tmp_path / "failing.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1=", "type": "python", "function": "tests.rewards:failing"})
                             + "\n" for i in range(64)))
    text = config_path.read_text().replace(str(config.data.train), str(train))
    config_path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("bootstrap =")))
    assert load_run_config(config_path).model.bootstrap is None  # built already; its lines have no answers
    t0 = time.monotonic()
    done = _tandem_run(config_path, tmp_path / "runs", _env(TANDEM_REWARD_FUNCTIONS='["tests.rewards:*"]'),
                       timeout_s=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    err = " ".join(done.stderr.split())
    assert "ended failed: the reward failed on 8 groups in a row (reward.fail_after)" in err, err
    assert "this reward function always fails" in err, err
    run_dir = next(p for p in (tmp_path / "runs").iterdir() if not p.name.startswith("."))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "failed" and "this reward function always fails" in summary["error"]
    assert summary["dropped"]["infra"] >= 8 and summary["steps"] == 0, summary
    assert [i["field"] for i in summary["incidents"]] == ["reward.fail_after"], summary["incidents"]
    print(f"a run whose reward always fails ended in {time.monotonic() - t0:.0f} s")


@pytest.mark.long
@pytest.mark.slow
def test_sigterm_stops_the_run_and_its_services_and_keeps_its_files(tmp_path, arith_model):
    config_path = short_run_config(tmp_path, arith_model, steps=200, checkpoint_every=50)
    job = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(config_path), "--runs",
                            str(tmp_path / "runs")], cwd=ROOT, env=_env(TANDEM_STACK_STOP_GRACE_S="5"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in job.stdout:  # wait until the run is created and training
            lines.append(line)
            if "prompt groups queued" in line:
                break
        assert job.poll() is None, "".join(lines) + job.stderr.read()
        run_id = line.split()[1].rstrip(":")
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, "".join(lines) + out + err
    assert "tandem run stopped: interrupted" in " ".join(err.split()), err
    assert not _owned_by_pid(job.pid), "a process the stack started is still alive"
    assert (tmp_path / "runs" / run_id / "logs").is_dir(), "the run's files were not kept under its id"
