"""``[eval] after`` for a run started with `tandem submit`: its final version is evaluated, though
``eval.every`` does not name it, and the run is finished only once that result is recorded.

Before, only `tandem run` evaluated the final version (over HTTP, after the run): a submitted 40-step run
with ``every = 10`` ended with version 30 as its newest evaluation. Here the learner asks the rollout
servers for the final version when it has trained the last step (``learner.service.evaluate_final``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from host.processes import die_with_parent, stop_group
from services import wire
from services.clients import ControlClient
from services.config import load_run_config
from services.run_states import TERMINAL_STATES
from tests.chaos.harness import write_config

STEPS = 4
EVERY = 3


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.stack
def test_a_submitted_run_gets_its_final_version_evaluated_before_it_finishes(tmp_path, arith_model):
    cfg_path = write_config(tmp_path, arith_model, STEPS, faults=False)
    text = cfg_path.read_text().replace("\nevery = 10 ", f"\nevery = {EVERY}\nmax_prompts = 8 ")
    cfg_path.write_text(text)
    config = load_run_config(cfg_path)
    assert (config.eval.every, config.eval.after, config.learner.steps % EVERY) == (EVERY, True, 1)
    stack_dir = tmp_path / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    up = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--config", str(cfg_path), "--run-dir", str(stack_dir)],
        env=env, stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True, preexec_fn=die_with_parent,
    )
    try:
        deadline = time.monotonic() + 900
        while not (stack_dir / "stack.json").exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "stack did not come up"
            time.sleep(1)
        info = json.loads((stack_dir / "stack.json").read_text())
        done = subprocess.run([sys.executable, "-m", "deploy.cli", "submit", str(config.data.train), "--config",
                               str(cfg_path)], env={**env, "TANDEM_RUN_DIR": str(stack_dir)},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        run_id = done.stdout.strip().splitlines()[-1]

        async def follow() -> tuple[wire.RunStatus, list[wire.MetricPoint]]:
            async with ControlClient(info["urls"]["control"], info["token"]) as control:
                while (st := await control.run_status(run_id)).run.state not in TERMINAL_STATES:
                    assert time.monotonic() < deadline + 900, "run did not finish"
                    await asyncio.sleep(1)
                return st, [p for p in await control.metrics(run_id) if p.source == "eval"]

        final, evals = asyncio.run(follow())
        assert final.run.state == "finished", final.run.error
        # the status of the finished run already holds the final version's result
        assert final.eval is not None and final.eval.version == final.run.policy_version == STEPS
        assert sorted(p.step for p in evals) == [0, EVERY, STEPS]
    finally:
        stop_group(up)
