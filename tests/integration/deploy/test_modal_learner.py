"""A learner per run, as deployed on Modal, run here: spawn, lease, timeout -> resume, end (real Redis,
real DeepSpeed on CPU, the real control plane and the app's real ``learner`` function body).

Modal's cloud cannot be reached, so :class:`SpawnSpy` stands in for it, and only for it: it replaces
``modal.Function.spawn`` of the app's ``learner`` (the one call ``deploy.modal_app._spawn_learner``
makes) and does what Modal does with a spawned call: run the function body in a container of its own
(here a process: ``learner.local(run_id)``, which runs torchrun exactly as in the container) and, while
that attempt fails, run it again up to ``[modal.learner].retries`` times (Modal's retries; a call that
hits its timeout counts as failed, and Modal SIGTERMs its container first). A producer plays the
rollout servers (trajectory groups of the latest version, ``tests.fixtures.learner.add_group``).

The story: the control plane accepts a run and spawns its learner; a second call for the same run
finds the run's lease held and returns at once, naming the holder; the first attempt is SIGTERMed
after step 3 (a timeout: its last periodic checkpoint is step 2), saves step 3, releases the lease
and fails the call; the retry resumes from step 3 exactly, trains to the last step, finishes the
run and returns; the ledger audits clean across the restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from host.processes import OWNER_VARIABLE, die_with_parent, free_port, owner_tag, stop_group
from tests.fixtures.control import ARITH_LINES, TOKEN, control_settings
from tests.fixtures.learner import read_jsonl
from tests.integration.learner.test_service import _produce

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
BODY = "import sys, deploy.modal_app as m; m.learner.local(sys.argv[1])"
"""What Modal runs in a learner container for a call: the app's learner function with the call's argument."""
DEPLOY = '[modal.learner]\ngpu = "L4:1"\nretries = 3\n'
"""One GPU per learner: one rank under torchrun (on CPU here)."""


class Attempt:
    """One attempt of a call, in a process of its own (the container), its learner's HTTP on ``port``."""

    def __init__(self, run_id: str, env: dict, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.tag = owner_tag(f"modal-learner-{os.getpid()}-{self.port}")
        env = {**env, "TANDEM_PORT": str(self.port), OWNER_VARIABLE: self.tag}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", BODY, run_id], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)

    def status(self) -> dict | None:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/v1/status", timeout=5)
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_group(self.proc, grace_s=5, owner=self.tag)


class SpawnSpy:
    """Spy standing in for Modal's cloud behind ``learner.spawn``: records each call and runs it as Modal
    would (module docstring)."""

    def __init__(self, env: dict, logs: Path, retries: int) -> None:
        self.env, self.logs, self.retries = env, logs, retries
        self.calls: list[str] = []
        self.attempts: dict[int, list[Attempt]] = {}
        self.tasks: list[asyncio.Task] = []

    async def aio(self, run_id: str):
        call = len(self.calls)
        self.calls.append(run_id)
        self.attempts[call] = [self._attempt(call, run_id)]
        self.tasks.append(asyncio.create_task(self._retry(call, run_id)))
        return type("FunctionCall", (), {"object_id": f"fc-spy-{call}"})()

    def _attempt(self, call: int, run_id: str) -> Attempt:
        return Attempt(run_id, self.env, self.logs / f"call{call}-attempt{len(self.attempts.get(call, []))}.log")

    async def _retry(self, call: int, run_id: str) -> None:
        while await asyncio.to_thread(self.attempts[call][-1].proc.wait) != 0:
            if len(self.attempts[call]) > self.retries:
                return
            self.attempts[call].append(self._attempt(call, run_id))

    def stop(self) -> None:
        for attempts in self.attempts.values():
            for a in attempts:
                a.stop()


async def _until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _run_config(model: Path) -> dict:
    return {
        "name": "modal-learner",
        "model": {"path": str(model), "max_model_len": 128},
        "data": {"train": "unused.jsonl"},
        "sampling": {"group_size": 4, "max_tokens": 16},
        "learner": {"zero_stage": 0, "lr": 1e-3, "groups_per_step": 2, "micro_batch_tokens": 256, "steps": 5,
                    "checkpoint_every": 2, "wait_timeout_s": 120.0},
        "staleness": {"max_staleness": 1},
        "publish": {"every": 1, "keep": 100},
        "loss": {"filter_zero_variance": True},
    }


@pytest.mark.long
async def test_a_learner_per_run_spawned_leased_interrupted_resumed_and_ended(
        control_db_url, control_redis, tiny_model, tmp_path, monkeypatch):
    import deploy.modal_app as modal_app
    from broker import Keys, Lease
    from control_plane import build_app
    from deploy.audit import audit_file
    from services.runs import RunStore

    deploy_toml = tmp_path / "modal.toml"
    deploy_toml.write_text(DEPLOY)
    run_dir = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env |= {"DEPLOY_MODAL_TOML": str(deploy_toml), "REDIS_URL": control_db_url, "TANDEM_RUN_DIR": str(run_dir),
            "TANDEM_LEARNER_LEASE_S": "4", "TANDEM_LOG_LEVEL": "warning", "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1"}
    spy = SpawnSpy(env, tmp_path, retries=3)
    monkeypatch.setattr(modal_app, "learner", type("LearnerSpy", (), {"spawn": spy})())

    settings = control_settings(control_db_url, tmp_path)
    app = build_app(settings, start_learner=modal_app._spawn_learner)
    stop = asyncio.Event()
    producer = None
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://control",
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                body = "\n".join(__import__("json").dumps(x) for x in ARITH_LINES).encode()
                up = await c.post("/v1/prompt-sets", content=body, headers={"Content-Type": "application/x-ndjson"})
                r = await c.post("/v1/runs", json={"prompt_set_id": up.json()["id"], "config": _run_config(tiny_model)})
                assert r.status_code == 201, r.text
        run_id = r.json()["run_id"]
        keys = Keys(run_id)
        assert spy.calls == [run_id]  # the control plane spawned the run's learner
        first = spy.attempts[0][0]

        # the run's lease is the first learner's; a second call for the same run gives up, naming it
        holder = await _until(lambda: asyncio.run(_holder(control_db_url, keys)), 240, "the lease to be taken")
        await modal_app._spawn_learner(run_id)
        duplicate = spy.attempts[1][0]
        assert await asyncio.to_thread(duplicate.proc.wait, 120) == 0, duplicate.text()
        assert f"learner {holder} holds its lease" in duplicate.text(), duplicate.text()
        assert len(spy.attempts[1]) == 1  # it returned: Modal does not retry it

        # a timeout: Modal SIGTERMs the container after step 3 (last periodic checkpoint: step 2)
        producer = asyncio.create_task(_produce(control_redis, keys, stop, backlog=2, limit=6))
        await _until(lambda: (s := first.status()) and s["step"] >= 3 and s["state"] == "waiting", 300, "step 3")
        first.proc.send_signal(15)
        await _until(lambda: len(spy.attempts[0]) == 2, 120, "the retry")
        assert first.proc.returncode != 0 and "stopped on signal 15" in first.text(), first.text()[-3000:]
        checkpoints = run_dir / run_id / "checkpoints"
        assert (checkpoints / "tandem-latest").read_text() == "step00000003"  # saved on SIGTERM
        assert (await RunStore(control_redis).get(run_id)).state == "running"
        await producer
        # exactly the groups steps 4 and 5 train (each has signal: none is dropped): a group queued while the
        # learner closes the run would be left open in its ledger, which the audit rightly calls lost
        producer = asyncio.create_task(_produce(control_redis, keys, stop, backlog=2, limit=4))

        # the retry resumes from step 3 exactly, trains to step 5, finishes the run and returns
        retry = spy.attempts[0][1]
        code = await asyncio.to_thread(retry.proc.wait, 400)
        assert code == 0, retry.text()[-3000:]
        assert (await RunStore(control_redis).get(run_id)).state == "finished"
        assert await Lease(control_redis, keys.learner_lease, "x", 1).current() is None  # released at the end
        ledger = read_jsonl(run_dir / run_id / "ledger.jsonl")
        assert [x["d"]["step"] for x in ledger if x["e"] == "started"] == [0, 3]  # the retry resumed at step 3
        trained = read_jsonl(run_dir / run_id / "learner" / "trained.jsonl")
        assert [t["step"] for t in trained] == [1, 2, 3, 4, 5]  # nothing trained twice, nothing lost
        assert len({t["pid"] for t in trained[:3]} | {t["pid"] for t in trained[3:]}) == 2
        verdict = audit_file(run_dir / run_id)
        assert verdict.ok, verdict.violations
        assert (verdict.starts, verdict.lost_steps, verdict.trained_twice, verdict.steps) == (2, 0, 0, 5)
        assert len(spy.attempts[0]) == 2
    finally:
        stop.set()
        if producer is not None:
            await producer
        spy.stop()


async def _holder(url: str, keys) -> str | None:
    from broker import Lease, connect

    redis = connect(url)
    try:
        return await Lease(redis, keys.learner_lease, "observer", 1).current()
    finally:
        await redis.aclose()
