"""``tandem serve rollout`` as a real process: it serves, runs the actor for a run, and
exits non-zero when its engine dies (so a supervisor restarts it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from broker import Envelope, Stream
from deploy.stack import wait_healthy
from host.processes import free_port, stop_group
from services import wire
from services.reward_specs import RegexSpec
from tests.fixtures.rollout import TOKEN

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


@pytest.mark.long
async def test_serve_rollout_process_runs_actor_and_exits_nonzero_on_engine_death(
    tiny_model, tmp_path, redis, redis_url, keys, reward_service
):
    train = tmp_path / "train.jsonl"
    train.write_text("")
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(
        f"""
name = "proc-test"
[model]
path = "{tiny_model}"
max_model_len = 256
[data]
train = "{train}"
[sampling]
group_size = 2
max_tokens = 8
[learner]
groups_per_step = 2
[staleness]
max_staleness = 1
"""
    )
    port = free_port()
    env = {
        **os.environ,
        "TANDEM_TOKEN": TOKEN,
        "TANDEM_RUN_ID": keys.run_id,
        "REDIS_URL": redis_url,
        "TANDEM_ROLLOUT_REWARD_URL": reward_service.url,
        "TANDEM_SERVER_ID": "proc-test",
        "TANDEM_ROLLOUT_KV_CACHE_GIB": "0.25",
        "TANDEM_ROLLOUT_FATAL_GRACE_S": "3",
    }
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "rollout", "--config", str(run_toml), "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_healthy, proc, url, 240, log)  # the in-process reward service keeps serving
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
            # the actor loop serves the run
            prompts = Stream.prompts(redis, keys)
            await prompts.ensure_group()
            gid = f"p-{uuid.uuid4().hex[:8]}"
            pg = wire.PromptGroup(run_id=keys.run_id, group_id=gid, prompt="1+1=", n=2, spec=RegexSpec(pattern="2"))
            await prompts.add(Envelope(gid, -1, wire.encode(pg)))
            traj = Stream.trajectories(redis, keys)
            await traj.ensure_group()
            got = []
            deadline = time.monotonic() + 90
            while not got:
                assert time.monotonic() < deadline, f"no trajectory group:\n{_tail(log)}"
                got = await traj.read("learner", count=1, block_ms=500)
            g = wire.decode(wire.TrajectoryGroup, got[0].envelope.payload)
            assert (g.group_id, g.rollout_id, g.policy_version, len(g.samples)) == (gid, "proc-test", 0, 2)

            r = await c.post("/v1/generate", json={"prompt": "1+1=", "n": 2, "max_tokens": 4})
            assert r.status_code == 200, r.text

            # kill the engine core: /healthz must fail, then the process exits non-zero
            cores = [p for p in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in p.name()]
            assert cores, [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
            for p in cores:
                p.kill()
            saw_503 = False
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    r = await c.get("/healthz")
                    saw_503 = saw_503 or r.status_code == 503
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
        assert saw_503, f"/healthz never reported the dead engine:\n{_tail(log)}"
        rc = proc.wait(timeout=60)
        assert rc != 0, _tail(log)
    finally:
        stop_group(proc)
