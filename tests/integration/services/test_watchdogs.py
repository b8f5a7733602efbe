"""Watchdogs (issue 13, item 4): each wait is made to hang for real and must end within its bound.

- reward call: a real reward server process, SIGSTOPped after it accepted the
  connection; the client's whole call ends within ``watchdog.score_s`` with a
  retryable error (the actor leaves the group for redelivery);
- weight reload: a version whose weight file reads for tens of minutes (1 TiB,
  sparse); the session engine refuses it within ``watchdog.reload_s`` and
  keeps serving the old version;
- generate: a request longer than ``watchdog.generate_s`` on the session
  engine is aborted (``Stalled``, the engine still answers); an engine whose
  core process is SIGSTOPped fails its probe and is failed (slow: a second
  engine);
- learner collective: a 2-rank gloo learner with rank 1 SIGSTOPped fails its
  run within ``watchdog.collective_s`` with an error naming the collective (slow);
- starvation: a run whose learner receives nothing fails with the reason in
  ``GET /v1/runs/{id}`` (slow);
- visibility: incidents in ``GET /v1/runs/{id}`` and ``tandem status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from broker import Keys
from deploy.stack import wait_healthy
from host.processes import free_port, stop_group
from services import wire
from services.clients import RewardClient, is_retryable
from services.config import WatchdogConfig
from services.reward_specs import ExactSpec
from services.watchdog import IncidentLog, Stalled

REPO = Path(__file__).resolve().parents[3]
TOKEN = "watchdog-test-token-0123"

pytestmark = pytest.mark.usefixtures("engine_left_serving")


@contextlib.contextmanager
def _watched(engine, limits: WatchdogConfig, sink):
    engine.watch(limits, sink, "rollout:test")
    try:
        yield
    finally:
        engine.watch(WatchdogConfig(), None, "rollout")


# -- reward call ------------------------------------------------------------------------


@pytest.fixture
def reward_process(tmp_path):
    port = free_port()
    log = tmp_path / "reward.log"
    env = {**os.environ, "TANDEM_TOKEN": TOKEN, "TANDEM_REWARD_SANDBOX": "none", "TANDEM_REWARD_WORKERS": "1",
           "TANDEM_LOG_LEVEL": "warning"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "reward", "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 90, log)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
        stop_group(proc, grace_s=10)


async def test_a_reward_server_that_accepts_and_never_answers_costs_at_most_score_s(reward_process, redis, keys):
    proc, url = reward_process
    request = wire.ScoreRequest(items=[wire.ScoreItem(id="a", completion="<answer>4</answer>",
                                                      spec=ExactSpec(answer="4"))])
    client = RewardClient(url, TOKEN, timeout_s=1.0, attempts=10, max_total_s=3.0, bound_field="watchdog.score_s",
                          incidents=IncidentLog(redis, keys), source="rollout:test")
    async with client:
        assert (await client.score(request)).results[0].reward == 1.0
        os.kill(proc.pid, signal.SIGSTOP)  # the listening socket stays open: connections are accepted
        try:
            t0 = time.monotonic()
            with pytest.raises(httpx.TimeoutException) as err:
                await client.score(request)
            took = time.monotonic() - t0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert 3.0 <= took < 5.0, took
        assert is_retryable(err.value)  # the actor's predicate: leave the group for a later delivery
        assert "POST /v1/score has waited" in str(err.value) and "config watchdog.score_s" in str(err.value)
        (inc,) = await IncidentLog(redis, keys).recent()
        assert inc.field == "watchdog.score_s" and inc.source == "rollout:test" and inc.limit_s == 3.0
        assert (await client.score(request)).results[0].reward == 1.0  # served again once it runs


# -- weight reload ------------------------------------------------------------------------


async def test_a_reload_whose_read_never_ends_is_refused_within_reload_s(rollout_engine, tmp_path, redis, keys):
    """The weight file is a sparse file of 1 TiB: verifying its checksum reads for tens of minutes
    (the store only hashes regular files, so a FIFO would be refused at once, not hang)."""
    from rollout_server.transports import PREPARE_THREAD, WeightLoadError

    version_dir = tmp_path / "v-huge"
    version_dir.mkdir()
    huge = version_dir / "model.safetensors"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    before = rollout_engine.version
    request = wire.LoadWeights(version=before + 1000, uri=version_dir.as_uri(), sha256="0" * 64)
    try:
        with _watched(rollout_engine, WatchdogConfig(reload_s=1.5), IncidentLog(redis, keys)):
            t0 = time.monotonic()
            with pytest.raises(WeightLoadError) as err:
                await rollout_engine.load_weights(request)
            took = time.monotonic() - t0
        assert 1.5 <= took < 5, took
        assert err.value.status == 503
        assert f"reload of version {before + 1000} has waited" in err.value.message
        assert "config watchdog.reload_s" in err.value.message and "the actor retries later" in err.value.message
        assert rollout_engine.version == before and rollout_engine.alive  # untouched, still serving
        (inc,) = await IncidentLog(redis, keys).recent()
        assert "in digest" in inc.stack and inc.source == "rollout:test"  # the reading thread's own stack
        from rollout_server.engine import Sampling

        gen = await rollout_engine.generate(rollout_engine.tokenize("1+1="), Sampling(max_tokens=4))
        assert gen.samples[0].policy_version == before
    finally:
        os.truncate(huge, 0)  # the abandoned reader reaches EOF and its thread ends
    for _ in range(50):
        if not any(t.name == PREPARE_THREAD for t in threading.enumerate()):
            break
        await asyncio.sleep(0.1)
    assert not any(t.name == PREPARE_THREAD for t in threading.enumerate())


# -- generate -----------------------------------------------------------------------------


async def test_a_generate_past_generate_s_is_aborted_and_the_engine_keeps_serving(rollout_engine, redis, keys):
    from rollout_server.engine import Sampling

    ids = rollout_engine.tokenize("1+1=")
    long = Sampling(n=16, max_tokens=200, temperature=1.0, seed=1)
    with _watched(rollout_engine, WatchdogConfig(generate_s=0.05), IncidentLog(redis, keys)):
        t0 = time.monotonic()
        with pytest.raises(Stalled) as err:
            await rollout_engine.generate(ids, long, source="actor")
        took = time.monotonic() - t0
    assert took < 10, took
    assert "config watchdog.generate_s" in str(err.value) and "left for redelivery" in str(err.value)
    assert err.value.status == 503  # over HTTP: 503 with Retry-After
    assert rollout_engine.alive
    (inc,) = await IncidentLog(redis, keys).recent()
    assert inc.what.startswith("generate actor-") and inc.field == "watchdog.generate_s"
    gen = await rollout_engine.generate(ids, Sampling(max_tokens=4))
    assert len(gen.samples) == 1


def _children(pid: int) -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


@contextlib.asynccontextmanager
async def _second_engine(tiny_model):
    """An engine of its own (the session's must stay healthy) and the pids of its core processes."""
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    before = _children(os.getpid())
    engine = await RolloutEngine.start(tiny_model, RolloutSettings(kv_cache_gib=0.1, enforce_eager=True),
                                metrics=RolloutMetrics(CollectorRegistry()), max_model_len=128, dtype="float32")
    cores = sorted(_children(os.getpid()) - before)
    try:
        assert cores, "the engine started no core process"
        yield engine, cores
    finally:
        for pid in cores:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        engine.shutdown()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
async def test_an_engine_whose_core_stopped_is_failed_within_generate_s(tiny_model, redis, keys):
    """The core process SIGSTOPped: the generate times out, the one-token probe gets no answer, the
    engine is failed (not ``alive``: the server's watchdog then exits non-zero for a restart)."""
    from rollout_server.engine import PROBE_S, Sampling
    from rollout_server.errors import EngineDead

    async with _second_engine(tiny_model) as (engine, cores):
        ids = engine.tokenize("1+1=")
        await engine.generate(ids, Sampling(max_tokens=2))
        engine.watch(WatchdogConfig(generate_s=2.0), IncidentLog(redis, keys), "rollout:stuck")
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match="a one-token probe got no answer"):
            await engine.generate(ids, Sampling(max_tokens=8))
        took = time.monotonic() - t0
        assert 2.0 + PROBE_S[0] <= took < 2.0 + PROBE_S[0] + 5, took
        assert not engine.alive and "config watchdog.generate_s" in engine.dead_reason
        (inc,) = await IncidentLog(redis, keys).recent()
        assert inc.source == "rollout:stuck" and "exits for a restart" in inc.action


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
async def test_a_reload_into_a_stopped_core_fails_the_engine_within_reload_s(tiny_model, redis, keys):
    """The version reads fine (it is the model's own weights), but the core that must load it is
    SIGSTOPped: past ``reload_s`` the engine, paused and half-loaded, is failed."""
    from rollout_server.errors import EngineDead
    from services.weightstore import digest

    async with _second_engine(tiny_model) as (engine, cores):
        engine.watch(WatchdogConfig(reload_s=2.0, generate_s=2.0), IncidentLog(redis, keys), "rollout:stuck")
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match=r"reload of version 1 has waited [\d.]+ s on .* \(limit 2 s, config "
                                             r"watchdog\.(reload|generate)_s\): the engine is stuck"):
            await engine.load_weights(wire.LoadWeights(version=1, uri=str(tiny_model), sha256=digest(tiny_model)))
        took = time.monotonic() - t0
        assert 2.0 <= took < 8, took
        assert not engine.alive and engine.version == 0
        (inc,) = await IncidentLog(redis, keys).recent()
        assert inc.what == "reload of version 1" and "exits for a restart" in inc.action


# -- learner --------------------------------------------------------------------------------


@pytest.mark.long
@pytest.mark.slow
async def test_a_rank_stuck_in_a_checkpoint_write_fails_the_collective_and_exits(
    redis, keys, tiny_model, tmp_path, learner_proc
):
    """2 ranks (gloo). Rank 1's checkpoint file is a FIFO nobody reads: its write blocks in the kernel
    (a hung filesystem), inside ``torch.save``, which holds the GIL. Rank 0 waits for it in the save's
    barrier: past ``collective_s`` that collective fails, named, and the run fails. Rank 1's step
    watchdog cannot run without the GIL; its backstop (faulthandler, ``step_s`` + 10 s) dumps rank 1's
    stack and exits 1, and torchrun ends the job non-zero, for the supervisor to restart."""
    from tests.fixtures.learner import add_group, write_run_config

    collective_s, step_s = 12.0, 25.0
    config = write_run_config(tmp_path / "run.toml", tiny_model, {
        "learner": {"steps": 4, "checkpoint_every": 1, "wait_timeout_s": 10.0},
        "watchdog": {"collective_s": collective_s, "step_s": step_s},
    })
    tag_dir = tmp_path / "runs" / keys.run_id / "checkpoints" / "step00000001"
    tag_dir.mkdir(parents=True)
    os.mkfifo(tag_dir / "rng-rank1.pt")
    for i in range(2):
        await add_group(redis, keys, 0, seed=i)
    proc = learner_proc(config, keys.run_id, nproc=2)
    try:
        await asyncio.to_thread(proc.proc.wait, 300 + step_s)
        log = proc.tail(400_000)
        assert proc.proc.returncode not in (None, 0), log[-6000:]
        rank0 = re.search(r"learner rank 0 of 2 has waited ([\d.]+) s on the collective checkpoint save step00000001 "
                          r"\(DeepSpeed's and the pointer's barriers\) \(a peer rank stopped answering\) "
                          r"\(limit 12 s, config watchdog.collective_s\); the run fails", log)
        assert rank0, log[-6000:]
        assert collective_s <= float(rank0[1]) < collective_s + 3
        backstop = re.search(r"Timeout \(0:00:([\d.]+)\)!\n(.*)", log, re.S)  # faulthandler, rank 1
        assert backstop, log[-6000:]
        assert abs(float(backstop[1]) - (step_s + 10)) < 1
        assert re.search(r'torch/serialization.py", line \d+ in save\n\s+File "\S+learner/engine.py", line \d+ in _save',
                         backstop[2]), backstop[2]  # rank 1's main thread, stuck in its checkpoint write
        assert re.search(r"exitcode\s*:\s*1", log), log[-3000:]  # torchrun saw rank 1 fail and ended the job
        print(f"collective named after {rank0[1]} s; rank 1 ended by the backstop after {backstop[1]} s")
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(tag_dir / "rng-rank1.pt", os.O_RDONLY | os.O_NONBLOCK))


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow
async def test_a_starved_run_fails_with_the_reason_in_its_status(
    control, control_db_url, tiny_model, tmp_path, learner_proc
):
    import tomllib

    from services.runs import RunStore
    from tests.fixtures.control import TOKEN as CONTROL_TOKEN
    from tests.fixtures.learner import write_run_config

    path = write_run_config(tmp_path / "run.toml", tiny_model, {"learner": {"wait_timeout_s": 3.0}})
    store = RunStore(control.redis)
    await store.create("starved", "ps-x", tomllib.loads(path.read_text()))
    learner_proc(path, None, url=control_db_url)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        record = await store.get("starved")
        if record.state == "failed":
            break
        await asyncio.sleep(0.3)
    resp = await control.client.get("/v1/runs/starved", headers={"Authorization": f"Bearer {CONTROL_TOKEN}"})
    status = wire.RunStatus.model_validate(resp.json())
    assert status.run.state == "failed", status.run
    assert status.run.error.startswith("DataTimeout: no usable trajectory group for 3 s"), status.run.error
    assert status.run.started_at is not None and status.run.finished_at - status.run.started_at < 60


# -- visibility -----------------------------------------------------------------------------


async def test_incidents_show_in_run_status_and_tandem_status(serve_control, control_redis):
    from services.runs import RunStore
    from services.watchdog import incident
    from tests.fixtures.control import TOKEN as CONTROL_TOKEN
    from tests.fixtures.control import run_config

    await RunStore(control_redis).create("wd-run", "ps-x", run_config())
    log = IncidentLog(control_redis, Keys("wd-run"), source="rollout:r1")
    for i in range(25):
        await log.append(incident(f"reload of version {i}", "reading /w", waited_s=120.4, limit_s=120,
                                  field="watchdog.reload_s", action="version refused"))
    async with serve_control() as url:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {CONTROL_TOKEN}"}) as http:
            status = wire.RunStatus.model_validate((await http.get("/v1/runs/wd-run")).json())
        assert [i.what for i in status.incidents[:2]] == ["reload of version 24", "reload of version 23"]
        assert len(status.incidents) == 20 and status.incidents[0].source == "rollout:r1"
        env = {**os.environ, "TANDEM_TOKEN": CONTROL_TOKEN, "COLUMNS": "250"}
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deploy.cli", "status", "wd-run", "--url", url, cwd=REPO, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out = (await asyncio.wait_for(cli.communicate(), 60))[0].decode()
    assert cli.returncode == 0, out
    assert "watchdog incidents" in out
    assert "reload of version 24 has waited 120.4 s on reading /w (limit 120 s, config watchdog.reload_s)" in out


@pytest.mark.browser
async def test_the_dashboard_lists_the_incidents(serve_control, control_redis, tmp_path):
    """Headless Chromium runs the dashboard's script against a real control plane: the incident list
    shows each incident's line, and the console stays empty (nothing the CSP refused, no error)."""
    from services.runs import RunStore
    from services.watchdog import incident
    from tests.fixtures.control import READ_TOKEN, run_config
    from tests.integration.control_plane.test_dashboard import _chromium, require_chromium

    require_chromium()
    await RunStore(control_redis).create("wd-dash", "ps-x", run_config())
    await IncidentLog(control_redis, Keys("wd-dash")).append(incident(
        "learner rank 0 of 2, step 7", "the collective all_reduce of the step statistics", waited_s=900.2,
        limit_s=900, field="watchdog.collective_s", action="the run fails", source="learner:rank0"))
    async with serve_control() as url:
        dom, console = await _chromium(f"{url}/?token={READ_TOKEN}&run=wd-dash", tmp_path / "chromium")
    assert not console, console
    items = re.findall(r'<li class="incident">([^<]*)</li>', dom)
    assert len(items) == 1, dom[-3000:]
    assert items[0].endswith(
        "learner:rank0: learner rank 0 of 2, step 7 has waited 900.2 s on the collective all_reduce of the step "
        "statistics (limit 900 s, config watchdog.collective_s); the run fails"), items[0]
    assert '<div id="incidents">' in dom  # shown (not hidden) once there is one
