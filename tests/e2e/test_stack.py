"""The real stack end to end: `tandem up`, `tandem submit`, training, shutdown.

Starts every service as `tandem up` does (embedded Redis, reward, control,
rollout with vLLM, learner with DeepSpeed) on the bootstrapped example
model, measures held-out accuracy through the services before and after a
short GRPO run submitted with `tandem submit`, checks the held-out evaluations
the rollout server made during the run (``eval.every``), checks every trained group
against the staleness bound, then SIGTERMs the supervisor and checks that no
process it started is left.
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

import pytest

from broker.processes import group_members
from services import wire
from services.clients import ControlClient, RewardClient, RolloutClient
from services.config import load_run_config
from services.evaluate import evaluate, load_eval_set
from tests.chaos.harness import ETA, write_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_up_submit_train_and_shutdown_leaves_nothing(tmp_path, arith_model):
    cfg_path = write_config(tmp_path, arith_model, STEPS, faults=False)
    config = load_run_config(cfg_path)
    stack_dir = tmp_path / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--config", str(cfg_path), "--run-dir", str(stack_dir)],
        env=env, stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
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

        submitted = subprocess.run(
            [sys.executable, "-m", "services.cli", "submit", str(config.data.train), "--config", str(cfg_path),
             "--url", urls["control"]],
            env={**env, "TANDEM_TOKEN": token}, capture_output=True, text=True, timeout=120,
        )
        assert submitted.returncode == 0, submitted.stderr
        run_id = submitted.stdout.strip().splitlines()[-1]

        async def follow() -> wire.RunStatus:
            async with ControlClient(urls["control"], token) as control:
                while True:
                    st = await control.run_status(run_id)
                    if st.run.state in wire.TERMINAL_STATES:
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
