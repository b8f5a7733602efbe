"""A shared weights volume (Modal): the learner commits a version before registering it, a rollout
server reloads the volume before reading one.

Modal cannot be reached here, so the real ``modal.Volume`` calls fail (no token). That is the
observable of the first two tests: with ``TANDEM_RUN_DIR_VOLUME`` set, the calls are made, in the
right place, and their failure keeps the version from being announced or loaded. The third runs the
learner against ``tests/fixtures/modal_spy`` (a spy standing in for Modal's cloud: per-container
views of the volume, commit, what a fresh container sees) and restarts it in a fresh container's
view, as Modal does when it retries a learner call. The success path on Modal itself is
``tests/integration/deploy/test_modal_live.py``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.learner import add_group, write_run_config

VOLUME = "tandem-test-volume"


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.usefixtures("engine_left_serving")
async def test_rollout_reloads_the_volume_before_reading_a_version(rollout_server, rollout_engine, weight_versions):
    good = weight_versions.make(seed=104)
    async with httpx.AsyncClient(base_url=rollout_server.url, headers=rollout_server.headers, timeout=120) as c:
        before = (await c.get("/v1/weights")).json()["version"]
        rollout_engine.volume = VOLUME
        try:
            r = await c.post("/v1/weights", json=good.model_dump())
        finally:
            rollout_engine.volume = None
        assert r.status_code == 503 and VOLUME in r.json()["detail"], r.text
        assert (await c.get("/v1/weights")).json()["version"] == before  # refused: old weights keep serving
        r = await c.post("/v1/weights", json=good.model_dump())  # without a volume the same version loads
        assert r.status_code == 200 and r.json()["version"] == good.version, r.text


@pytest.mark.slow
async def test_learner_commits_the_volume_before_registering_a_version(
        redis, keys, tiny_model, tmp_path, learner_proc, monkeypatch):
    from broker import WeightRegistry

    monkeypatch.setenv("TANDEM_RUN_DIR_VOLUME", VOLUME)
    cfg = write_run_config(tmp_path / "run.toml", tiny_model,
                           {"learner": {"steps": 1, "checkpoint_every": 0}})
    for seed in (1, 2):
        await add_group(redis, keys, 0, seed=seed)
    proc = learner_proc(cfg, keys.run_id)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.proc.poll() is None:
        st = await asyncio.to_thread(proc.status)
        if st is not None and st.get("state") in ("failed", "done"):
            break
        await asyncio.sleep(0.3)
    assert st is not None and st["state"] == "failed", (st, proc.tail())
    assert "Token missing" in st["error"] or VOLUME in st["error"], st["error"]
    # the version was written but never announced: no rollout server is told of weights it cannot see
    assert await WeightRegistry(redis, keys).history() == []
    assert (tmp_path / "runs" / keys.run_id / "weights" / "v00000001" / "model.safetensors").is_file()


SPY = Path(__file__).resolve().parents[2] / "fixtures" / "modal_spy"


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow
async def test_a_retried_learner_in_a_fresh_container_resumes_from_its_last_checkpoint(
        redis, keys, tiny_model, tmp_path, learner_proc, monkeypatch):
    """The first learner trains 2 steps (checkpoint at step 2, its groups acknowledged) and is killed; a
    second starts from what the volume committed, as a retried Modal call does in a new container. It
    must find the step-2 checkpoint: the groups acknowledged as trained live only in those weights
    (before checkpoints were committed, the volume held the versions but not the checkpoint: the second
    learner started from step 0, and the audit found steps 1 and 2 trained with twice their groups)."""
    from deploy.audit import audit_file
    from tests.integration.learner.test_service import _produce, _wait

    store = tmp_path / "volume" / "store"
    first_view, second_view = tmp_path / "container-1" / "runs", tmp_path / "container-2" / "runs"
    first_view.mkdir(parents=True)
    monkeypatch.setenv("TANDEM_RUN_DIR_VOLUME", VOLUME)
    monkeypatch.setenv("PYTHONPATH", f"{SPY}:{Path(__file__).resolve().parents[3]}")
    monkeypatch.setenv("SPY_MODAL_VOLUME_STORE", str(store))
    monkeypatch.setenv("SPY_MODAL_VOLUME_VIEW", str(first_view))
    cfg = write_run_config(tmp_path / "run.toml", tiny_model,
                           {"staleness": {"max_staleness": 1}, "learner": {"steps": 4, "checkpoint_every": 2}})
    stop = asyncio.Event()
    producer = asyncio.create_task(_produce(redis, keys, stop, backlog=2, limit=4))  # 2 steps' worth
    try:
        first = learner_proc(cfg, keys.run_id, first_view)
        await _wait(first, lambda s: s["step"] >= 2 and s["state"] == "waiting", 300, "step 2")
        first.kill9()
        await producer
        calls = [json.loads(x) for x in (store.parent / "calls.jsonl").read_text().splitlines()]
        assert {c["call"] for c in calls} == {"commit"}, calls  # the spy stood in for Modal
        shutil.copytree(store, second_view)  # a new container sees the committed volume, nothing else
        monkeypatch.setenv("SPY_MODAL_VOLUME_VIEW", str(second_view))
        producer = asyncio.create_task(_produce(redis, keys, stop, backlog=2))
        second = learner_proc(cfg, keys.run_id, second_view)
        st = await _wait(second, lambda s: s["state"] == "done", 300, "4 steps after the retry")
    finally:
        stop.set()
        await producer
    verdict = audit_file(second_view / keys.run_id)
    assert verdict.ok, verdict.violations
    assert st["resumed_from"] == 2, st
    assert (verdict.trained, verdict.trained_twice, verdict.lost, verdict.starts) == (8, 0, 0, 2)
