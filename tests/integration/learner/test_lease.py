"""One learner per run under ``tandem up`` too: the standing learner holds the run's lease (real Redis,
real DeepSpeed on CPU). A second standing learner started by hand on the same registry leaves the
run alone, naming the holder, and keeps following the registry."""

from __future__ import annotations

import asyncio
import os
import tomllib

import pytest

from tests.fixtures.learner import read_jsonl, write_run_config
from tests.integration.learner.test_service import _produce, _wait, _wait_run

pytestmark = pytest.mark.slow


@pytest.mark.long
async def test_a_second_standing_learner_leaves_a_leased_run_alone(
        control_db_url, control_redis, tiny_model, tmp_path, learner_proc, monkeypatch):
    from broker import Keys, Lease
    from services.runs import RunStore

    monkeypatch.setenv("TANDEM_LEARNER_LEASE_S", "3")
    store = RunStore(control_redis)
    path = write_run_config(tmp_path / "run.toml", tiny_model, {"learner": {"steps": 3, "checkpoint_every": 0}})
    first = learner_proc(path, None, url=control_db_url)
    await _wait(first, lambda s: s["state"] == "idle", 120, "an idle learner")
    stop = asyncio.Event()
    await store.create("leased", "ps-x", tomllib.loads(path.read_text()))
    keys = Keys("leased")
    producer = asyncio.create_task(_produce(control_redis, keys, stop, backlog=2, limit=2))  # one step's worth
    try:
        await _wait(first, lambda s: s["run_id"] == "leased" and s["step"] >= 1, 300, "the first learner training")
        holder = await Lease(control_redis, keys.learner_lease, "observer", 1).current()
        assert holder == f"{os.uname().nodename}:{first.proc.pid}"
        second = learner_proc(path, None, url=control_db_url)
        deadline = asyncio.get_running_loop().time() + 120
        while f"learner {holder} holds its lease" not in second.tail(20000):
            assert asyncio.get_running_loop().time() < deadline, second.tail()
            await asyncio.sleep(0.5)
        assert second.status()["run_id"] is None and second.proc.poll() is None  # still following, idle
        await producer
        producer = asyncio.create_task(_produce(control_redis, keys, stop, backlog=2))
        await _wait_run(store, "leased", lambda r: r.state == "finished", 300, "the run to finish")
    finally:
        stop.set()
        await producer
    trained = read_jsonl(tmp_path / "runs" / "leased" / "learner" / "trained.jsonl")
    assert [t["step"] for t in trained] == [1, 2, 3] and {t["pid"] for t in trained} == {first.proc.pid}
    assert await Lease(control_redis, keys.learner_lease, "observer", 1).current() is None  # released


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
async def test_a_learner_restarted_under_its_holder_id_takes_its_lease_over_at_once(
        control_db_url, control_redis, tiny_model, tmp_path, learner_proc, monkeypatch):
    """`tandem up` restarts a crashed learner under the same holder id (the stack's), as Modal retries a
    call under the call's id: the new process must not wait out the dead one's lease (300 s here)."""
    from broker import Keys, Lease
    from deploy.stack import Stack
    from services.runs import RunStore

    env = Stack(tmp_path / "stack")._env({})
    assert env["TANDEM_LEARNER_HOLDER"] == Stack(tmp_path / "stack")._env({})["TANDEM_LEARNER_HOLDER"]
    assert str(tmp_path / "stack") in env["TANDEM_LEARNER_HOLDER"]  # one id per stack, whichever process
    monkeypatch.setenv("TANDEM_LEARNER_HOLDER", env["TANDEM_LEARNER_HOLDER"])
    monkeypatch.setenv("TANDEM_LEARNER_LEASE_S", "300")
    store = RunStore(control_redis)
    path = write_run_config(tmp_path / "run.toml", tiny_model, {"learner": {"steps": 3, "checkpoint_every": 1}})
    await store.create("restarted", "ps-x", tomllib.loads(path.read_text()))
    keys = Keys("restarted")
    stop = asyncio.Event()
    producer = asyncio.create_task(_produce(control_redis, keys, stop, backlog=2, limit=2))
    try:
        first = learner_proc(path, None, url=control_db_url)
        await _wait(first, lambda s: s["run_id"] == "restarted" and s["step"] >= 1, 300, "step 1")
        first.kill9()
        assert await Lease(control_redis, keys.learner_lease, "observer", 1).current() == env["TANDEM_LEARNER_HOLDER"]
        await producer
        producer = asyncio.create_task(_produce(control_redis, keys, stop, backlog=2))
        t0 = asyncio.get_running_loop().time()
        second = learner_proc(path, None, url=control_db_url)
        await _wait_run(store, "restarted", lambda r: r.state == "finished", 200, "the run to finish")
        assert asyncio.get_running_loop().time() - t0 < 200 and second.proc.poll() is None
    finally:
        stop.set()
        await producer
