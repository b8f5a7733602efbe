"""A short version of ``bench/load.py`` (issue 13, item 5): the real services under concurrent load.

The reward server (default sandbox backend) and the control plane run as
``tandem serve`` processes on an embedded Redis of their own; the rollout
server serves the session's engine (shared with the other tests, so it is
not in the census) with room for 8 sequences, so that 20 requests fill it. The loads are the bench's
``QUICK`` set: 40 ``/v1/score`` with hostile programs mixed in, 20
``/v1/generate``, 5 prompt-set uploads, 10 dashboard pollers, each on its
own and all at once, after a first round that fills the pools.

Also here: the control plane's own limits under load, each shown directly
(at most ``MAX_UPLOADS`` uploads at once, a bounded Redis pool, 503 with
``Retry-After`` when Redis cannot serve a request).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    if "bench_load" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_load", ROOT / "bench/load.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_load"] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules["bench_load"]


@pytest.fixture
async def tight_rollout(rollout_engine, serve_app):
    """The rollout app around the session engine with room for 8 sequences: 20 requests fill it."""
    from pydantic import SecretStr

    from rollout_server import build_app
    from rollout_server.settings import RolloutSettings
    from tests.fixtures.rollout import TOKEN

    settings = RolloutSettings(token=SecretStr(TOKEN), max_n=16, max_pending_seqs=8)
    async with serve_app(build_app(settings, engine=rollout_engine)) as running:
        yield running


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.usefixtures("engine_left_serving")
async def test_services_under_load_refuse_with_retry_after_stay_healthy_and_leak_nothing(tight_rollout, tiny_model):
    load = _bench()
    rollout = load.Service("rollout", tight_rollout.url, tight_rollout.token, pid=None)
    async with load.started(tiny_model, rollout=rollout) as targets:
        report = await load.measure(targets, load.QUICK, settle_s=30)

    rows = report["round_1"] + report["results"]
    assert len(rows) == 12
    for row in rows:
        assert row["ok"] + row["429"] + row["503"] == row["requests"], row  # nothing else: no 500, no reset
        assert row["refused_without_retry_after"] == 0, row
        assert not row["problems"], row  # every verdict right, every sample there
    alone = {r["load"]: r for r in report["results"]}
    assert alone["score"]["429"] > 0 and alone["score"]["ok"] > 0, alone  # 40 jobs, 16 queue places
    assert alone["generate"]["503"] > 0 and alone["generate"]["ok"] > 0, alone  # 20 sequences, room for 8
    assert report["healthz"] == {"reward": 200, "rollout": 200, "control": 200, "redis": 200}
    assert report["leaks"] == {}, report["census_before"]
    reward = report["census_after"]["reward"]
    assert reward["sandboxes"] >= 1 and reward["temp_dirs"] >= 1
    assert load.verdict(report) == []


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_control_plane_bounds_its_redis_connections_and_answers_503_without_redis(tmp_path, tiny_model):
    """100 dashboard polls at once share at most REDIS_CONNECTIONS connections and all succeed; with
    Redis gone the control plane answers 503 with Retry-After, not 500, once its reconnection attempts
    (TANDEM_CONTROL_REDIS_RETRIES=2 here; the default 30 takes about 25 s) are spent."""
    from broker.embedded import EmbeddedRedis
    from control_plane.app import REDIS_CONNECTIONS
    from host.processes import stop_groups

    load = _bench()
    redis = EmbeddedRedis(tmp_path / "redis").start()
    control = None
    try:
        control = load.start_control(tmp_path, redis.url, tiny_model, {"TANDEM_CONTROL_REDIS_RETRIES": "2"})
        run_id = await load.create_run(control, tiny_model)
        redis_service = load.Service("redis", redis.url, "", redis.proc.pid)
        poll = load.Load("poll", 100, 2)
        async with control.client(poll.clients) as client:
            result = await load.run_load(poll, client, load.sender_poll(run_id))
        assert result.count("ok") == poll.requests, result.summary()
        counts = load.census([control, redis_service])
        assert 0 < counts["control"]["redis_connections"] <= REDIS_CONNECTIONS, counts
        assert counts["redis"]["clients"] <= REDIS_CONNECTIONS, counts

        redis.stop()
        async with control.client(2) as client:
            for path in ("/v1/runs", f"/v1/runs/{run_id}"):
                t0 = time.monotonic()
                resp = await client.get(path)
                assert time.monotonic() - t0 < 15, "the control plane did not take TANDEM_CONTROL_REDIS_RETRIES"
                assert resp.status_code == 503, resp.text
                assert int(resp.headers["retry-after"]) >= 1
                assert "Redis unavailable" in resp.json()["detail"]
            assert (await client.get("/healthz")).status_code == 503
    finally:
        if control is not None:
            stop_groups([control.proc], 10)
        redis.stop()


async def test_uploads_beyond_max_uploads_get_429_with_retry_after(control):
    """MAX_UPLOADS uploads held open; one more is refused at once (429, Retry-After); the held ones
    then finish and are stored."""
    from control_plane.prompt_sets import MAX_UPLOADS

    load = _bench()
    release = asyncio.Event()

    def held(i: int):
        async def body():
            yield load.prompt_set(i, 5)
            await release.wait()
            yield load.prompt_set(1000 + i, 5)

        return body()

    headers = {**control.auth(), "Content-Type": "application/x-ndjson"}
    pending = [asyncio.create_task(control.client.post("/v1/prompt-sets", content=held(i), headers=headers))
               for i in range(MAX_UPLOADS)]
    store = control.app.state.prompt_sets
    for _ in range(200):
        if store.uploading == MAX_UPLOADS:
            break
        await asyncio.sleep(0.01)
    assert store.uploading == MAX_UPLOADS

    refused = await control.client.post("/v1/prompt-sets", content=load.prompt_set(99, 5), headers=headers)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    release.set()
    done: list[httpx.Response] = await asyncio.gather(*pending)
    assert [r.status_code for r in done] == [201] * MAX_UPLOADS, [r.text for r in done]
    assert store.uploading == 0
    again = await control.client.post("/v1/prompt-sets", content=load.prompt_set(99, 5), headers=headers)
    assert again.status_code == 201, again.text

