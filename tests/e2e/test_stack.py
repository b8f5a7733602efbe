"""The real stack end to end: `tandem up`, `tandem submit`, a stopped run, training, shutdown.

Starts every service as `tandem up` does (embedded Redis, reward, control,
rollout with vLLM, learner with DeepSpeed) on the bootstrapped example
model and measures held-out accuracy through the services. Then:

- run A is submitted and, once it has trained 2 steps, stopped through the
  control plane (``POST /v1/runs/{id}/stop``). Within a bounded time the
  learner ends it (the ledger's ``closed`` entry, reason ``run_stopped``);
  after that, over a quiet window as long as one in which A had been
  producing groups, the ledger gets no entry, the learner trains and
  publishes nothing, and the rollout server generates no token and holds no
  group in flight;
- run B, a short GRPO run on the same services, trains to its end: the
  held-out evaluations the rollout server made during it (``eval.every``;
  version 0 is the base model again, not A's weights), every trained group
  against the staleness bound, both runs' ledgers through the audit, and
  held-out accuracy after it. Run B also goes to TensorBoard through the
  control plane ([logging] trackers) and keeps its best-scored version beyond
  the rolling window (publish.keep_best), which ``tandem export --version
  best`` writes after the stack has stopped.

Then it SIGTERMs the supervisor and checks that no process it started is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from broker import Keys, connect
from broker.ledger import Ledger
from deploy.audit import audit_file
from host.processes import die_with_parent, group_members
from services import wire
from services.clients import ControlClient, RewardClient, RolloutClient
from services.config import load_run_config
from services.evaluate import evaluate, load_eval_set
from services.run_states import TERMINAL_STATES
from tests.chaos.harness import ETA, write_config
from tests.fixtures.stack import short_run_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
QUIET_S = 6.0
"""The window in which a stopped run must do nothing (run A did something in the same window before)."""
ACTIVITY = {"admitted", "generated", "handed", "trained", "published", "loaded", "started", "retracted"}


def _submit(cfg_path: Path, url: str, env: dict[str, str]) -> str:
    train = load_run_config(cfg_path).data.train
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "submit", str(train), "--config", str(cfg_path),
                           "--url", url], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


async def _ledger(redis_url: str, run_id: str) -> list[dict]:
    redis = connect(redis_url)
    try:
        return await Ledger(redis, Keys(run_id)).read()
    finally:
        await redis.aclose()


def _rollout_metric(url: str, token: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _stop_a_run_and_watch_it_go_quiet(cfg_path: Path, urls: dict, token: str, env: dict, stack_dir: Path,
                                      redis_url: str) -> str:
    """Run A: submitted, stopped after 2 steps; then nothing of it may happen any more. Returns its id."""
    run_a = _submit(cfg_path, urls["control"], env)

    async def reach_step_2() -> None:
        async with ControlClient(urls["control"], token) as control:
            deadline = time.monotonic() + 600
            while (st := await control.run_status(run_a)).run.step < 2:
                assert st.run.state not in TERMINAL_STATES, st.run
                assert time.monotonic() < deadline, "run A did not reach step 2"
                await asyncio.sleep(0.5)

    asyncio.run(reach_step_2())
    generated = [e for e in asyncio.run(_ledger(redis_url, run_a)) if e["e"] == "generated"]
    busy = [e for e in generated if e["t"] >= generated[-1]["t"] - QUIET_S * 1000]  # A's work just before the stop

    async def stop() -> str:
        async with ControlClient(urls["control"], token) as control:
            return (await control.stop_run(run_a)).state

    t_stop = time.monotonic()
    assert asyncio.run(stop()) == "stopped"
    while not [e for e in asyncio.run(_ledger(redis_url, run_a)) if e["e"] == "closed"]:
        assert time.monotonic() < t_stop + 60, "the learner did not end the stopped run within 60 s"
        time.sleep(0.5)
    closed_after = time.monotonic() - t_stop
    time.sleep(1.0)  # the rollout server's run watcher polls every 0.5 s
    learner_dir = stack_dir / run_a / "learner"
    files = (_lines(learner_dir / "trained.jsonl"), _lines(learner_dir / "published.jsonl"))
    tokens = _rollout_metric(urls["rollout"], token, "tandem_rollout_generated_tokens_total")
    entries = len(asyncio.run(_ledger(redis_url, run_a)))
    time.sleep(QUIET_S)
    after = asyncio.run(_ledger(redis_url, run_a))
    closed_at = next(i for i, e in enumerate(after) if e["e"] == "closed")
    assert after[closed_at]["d"]["reason"] == "run_stopped"
    assert not [e["e"] for e in after[closed_at:] if e["e"] in ACTIVITY], after[closed_at:][:5]
    assert len(after) == entries, after[entries:][:5]
    assert (_lines(learner_dir / "trained.jsonl"), _lines(learner_dir / "published.jsonl")) == files
    assert _rollout_metric(urls["rollout"], token, "tandem_rollout_generated_tokens_total") == tokens
    in_flight = _rollout_metric(urls["rollout"], token, "tandem_rollout_groups_in_flight")
    assert in_flight == 0, "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in (stack_dir / "logs").glob("rollout*.log"))
    print(f"run A: {len(busy)} groups generated in the {QUIET_S:g} s before the stop, none after; "
          f"ledger closed {closed_after:.1f} s after the stop")
    assert busy, "run A generated nothing before the stop: the quiet window proves nothing"
    return run_a


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.long
@pytest.mark.slow
def test_up_submit_train_and_shutdown_leaves_nothing(tmp_path, arith_model):
    cfg_path = write_config(tmp_path, arith_model, STEPS, faults=False)
    # run B logs to TensorBoard and keeps its best-scored version (docs/trackers.md, docs/export.md)
    cfg_path.write_text(cfg_path.read_text().replace("\nkeep = 3", "\nkeep = 3\nkeep_best = 1")
                        + '\n[logging]\ntrackers = ["tensorboard"]\n')
    config = load_run_config(cfg_path)
    assert (config.publish.keep_best, config.logging.trackers) == (1, ["tensorboard"])
    stack_dir = tmp_path / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    up = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--config", str(cfg_path), "--run-dir", str(stack_dir)],
        env=env, stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=die_with_parent,
    )
    info_file = stack_dir / "stack.json"
    try:
        deadline = time.monotonic() + 600
        while not info_file.exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "stack did not come up"
            time.sleep(1)
        info = json.loads(info_file.read_text())
        urls, token = info["urls"], info["token"]
        items = load_eval_set(config.data.eval, config, None)

        async def measure() -> float:
            async with RolloutClient(urls["rollout"], token) as r, RewardClient(urls["reward"], token) as s:
                return (await evaluate(r, s, items, config)).accuracy

        before = asyncio.run(measure())

        (tmp_path / "a").mkdir()
        cfg_a = short_run_config(tmp_path / "a", arith_model, steps=100, checkpoint_every=3)
        run_a = _stop_a_run_and_watch_it_go_quiet(cfg_a, urls, token, {**env, "TANDEM_TOKEN": token}, stack_dir,
                                                  info["redis_url"])

        run_id = _submit(cfg_path, urls["control"], {**env, "TANDEM_TOKEN": token})

        async def follow() -> wire.RunStatus:
            async with ControlClient(urls["control"], token) as control:
                while True:
                    st = await control.run_status(run_id)
                    if st.run.state in TERMINAL_STATES:
                        return st
                    assert time.monotonic() < deadline + 600, "run did not finish"
                    await asyncio.sleep(2)

        final = asyncio.run(follow())
        assert final.run.state == "finished", final.run.error
        assert final.run.step == STEPS

        # the rollout server evaluated versions 0, every, 2 * every, ... during the run (tandem submit
        # uploaded data.eval): one point each, of every held-out prompt
        async def eval_points() -> list[wire.MetricPoint]:
            async with ControlClient(urls["control"], token) as control:
                return [p for p in await control.metrics(run_id) if p.source == "eval"]

        evals = asyncio.run(eval_points())
        every = config.eval.every
        assert every > 0 and STEPS >= 2 * every
        steps = [p.step for p in evals]
        assert len(steps) == len(set(steps)) and set(range(0, STEPS, every)) <= set(steps), steps
        assert {p.values["count"] for p in evals} == {len(items)}
        v0 = next(p.values["accuracy"] for p in evals if p.step == 0)
        assert abs(v0 - before) <= 0.03, (v0, before)  # the same weights, greedy, batched differently

        # every trained group obeyed eta: step k (producing version k) used versions in [k-1-eta, k-1]
        trained = [json.loads(x) for x in (stack_dir / run_id / "learner" / "trained.jsonl").read_text().splitlines()]
        assert len(trained) == STEPS
        for row in trained:
            v_learner = row["version"] - 1
            assert all(0 <= v_learner - v <= ETA for v in row["group_versions"]), row
        assert final.staleness.max_observed_lag is not None and final.staleness.max_observed_lag <= ETA
        verdict = audit_file(stack_dir / run_id).as_dict()
        assert verdict["ok"] and verdict["groups"]["trained"] > 0, verdict
        verdict_a = audit_file(stack_dir / run_a).as_dict()
        assert verdict_a["ok"] and verdict_a["closed"] == "run_stopped", verdict_a

        async def load_final() -> None:
            async with RolloutClient(urls["rollout"], token) as r:
                latest = await r.weights()
                if latest.version < STEPS:
                    from broker import Keys, WeightRegistry, connect

                    client = connect(info["redis_url"])
                    wv = await WeightRegistry(client, Keys(run_id)).latest()
                    await client.aclose()
                    await r.load_weights(wire.LoadWeights(version=wv.version, uri=wv.uri, sha256=wv.sha256))
                assert (await r.weights()).version == STEPS

        asyncio.run(load_final())
        after = asyncio.run(measure())
        print(f"held-out accuracy {before:.3f} -> {after:.3f} after {STEPS} steps")
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(timeout=90)
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
    pids = info["pids"]
    assert pids and not [p for p in pids if _alive(p)], "a service outlived tandem up"
    assert not [p for pgid in pids for p in group_members(pgid)], "a process of a service's group outlived tandem up"
    # 200 held-out prompts (one is 0.5 points): a 5-point margin is not rounding luck
    assert after >= before + 0.05, f"held-out accuracy did not rise: {before:.3f} -> {after:.3f}"

    # run B in TensorBoard: the control plane followed it, every step once, every evaluation
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(stack_dir / run_id / "trackers" / "tensorboard" / run_id), {"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    logged = {e.step: e.value for e in events.Scalars("eval/accuracy")}
    assert set(steps) <= set(logged)
    # the best-scored version outlived the rolling window and `tandem export --version best` writes it
    retention = json.loads((stack_dir / run_id / "weights" / "retention.json").read_text())
    scores = {int(v): s for v, s in retention["scores"].items()}
    assert all(logged[v] == pytest.approx(s) for v, s in scores.items())
    kept = sorted(int(p.name[1:]) for p in (stack_dir / run_id / "weights").glob("v*"))
    best = max((v for v in scores if v in kept), key=lambda v: (scores[v], v))
    assert retention["best"] == [best] and kept[-3:] == [STEPS - 2, STEPS - 1, STEPS]
    exported = subprocess.run([sys.executable, "-m", "deploy.cli", "export", run_id, str(tmp_path / "best"),
                               "--version", "best", "--stack-dir", str(stack_dir), "--runs", str(tmp_path / "none")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "best" / "tandem-export.json").read_text())["version"] == best
