"""A shared weights volume (Modal): the learner commits a version before registering it, a rollout
server reloads the volume before reading one.

Modal cannot be reached here, so the real ``modal.Volume`` calls fail (no token). That is the
observable: with ``TANDEM_RUN_DIR_VOLUME`` set, the calls are made, in the right place, and their
failure keeps the version from being announced or loaded. The success path needs a Modal
container (``tests/integration/deploy/test_modal_live.py``).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.fixtures.learner import add_group, write_run_config

VOLUME = "tandem-test-volume"


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
