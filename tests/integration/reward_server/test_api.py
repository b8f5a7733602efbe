"""The reward server's HTTP edge: auth, malformed requests, admission (429), refusal without a sandbox."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.clients import RewardClient
from services.reward_specs import Limits
from services.wire import ExecuteRequest
from tests.fixtures.reward import REWARD_TOKEN


@pytest.fixture
def gvisor_server(reward_servers):
    return reward_servers["gvisor"]


async def test_auth_is_required_except_healthz(gvisor_server):
    async with httpx.AsyncClient(base_url=gvisor_server.url, timeout=30) as anon:
        assert (await anon.get("/healthz")).status_code == 200
        missing = await anon.post("/v1/execute", json={"code": "print(1)"})
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        wrong = await anon.post("/v1/score", json={"items": []}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert (await anon.get("/metrics")).status_code == 401


async def test_metrics_count_runs(gvisor_server):
    async with gvisor_server.client() as client:
        assert (await client.post("/v1/execute", json={"code": "print(1)"})).json()["status"] == "ok"
        text = (await client.get("/metrics")).text
    assert 'reward_exec_runs_total{status="ok"}' in text
    assert "reward_exec_seconds_bucket" in text


async def test_client_round_trip(gvisor_server):
    client = RewardClient(gvisor_server.url, REWARD_TOKEN)
    async with client:
        result = await client.execute(ExecuteRequest(code="import sys\nprint(sys.stdin.read().upper())", stdin="abc",
                                                     files={"data/x.txt": "hello"}, limits=Limits(wall_s=5)))
        assert result.status == "ok" and result.stdout == "ABC\n"
        files = await client.execute(ExecuteRequest(code="print(open('data/x.txt').read())", files={"data/x.txt": "hello"}))
        assert files.stdout == "hello\n"


async def test_malformed_requests(gvisor_server):
    async with gvisor_server.client() as client:
        unknown = await client.post("/v1/execute", json={"language": "cobol", "code": "DISPLAY 'HI'."})
        assert unknown.status_code == 422 and "language" in unknown.json()["message"]
        empty = await client.post("/v1/execute", json={"code": ""})
        assert empty.status_code == 422 and "code" in empty.json()["message"]
        bad_limit = await client.post("/v1/execute", json={"code": "print(1)", "limits": {"wall_s": -1}})
        assert bad_limit.status_code == 422 and "limits.wall_s" in bad_limit.json()["message"]
        bad_spec = await client.post("/v1/score", json={"items": [
            {"id": "a", "completion": "x", "spec": {"type": "numeric", "answer": "not a number"}}]})
        assert bad_spec.status_code == 422 and "answer" in bad_spec.json()["message"]
        no_tests = await client.post("/v1/score", json={"items": [
            {"id": "a", "completion": "x", "spec": {"type": "python_tests"}}]})
        assert no_tests.status_code == 422 and "items.0.spec" in no_tests.json()["message"]
        bad_regex = await client.post("/v1/score", json={"items": [
            {"id": "a", "completion": "x", "spec": {"type": "regex", "pattern": "(unclosed"}}]})
        assert bad_regex.status_code == 422 and "items.0.spec.regex.pattern" in bad_regex.json()["message"]
        bad_type = await client.post("/v1/score", json={"items": [{"id": "a", "completion": "x", "spec": {"type": "vibes"}}]})
        assert bad_type.status_code == 422
        giant = await client.post("/v1/execute", json={"code": "#" * (65 << 20)})
        assert giant.status_code == 413
        # and the server is fine afterwards
        assert (await client.post("/v1/execute", json={"code": "print(2+2)"})).json()["stdout"] == "4\n"


async def test_full_queue_answers_429_with_retry_after(reward_app):
    async with reward_app(sandbox="bwrap", workers=1, max_queued=1) as (app, client):
        slow = asyncio.create_task(client.post("/v1/execute", json={
            "code": "import time\ntime.sleep(3)", "limits": {"wall_s": 10}}))
        deadline = time.monotonic() + 10
        while app.state.scorer.queue.admitted < 1:  # wait for the slow job's admission, however long it takes
            assert time.monotonic() < deadline and not slow.done(), "the slow job was never admitted"
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/execute", json={"code": "print(1)"})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert (await slow).json()["status"] == "ok"
        assert (await client.post("/v1/execute", json={"code": "print(1)"})).status_code == 200


async def test_without_a_sandbox_code_is_refused(reward_app):
    async with reward_app(sandbox="none") as (app, client):
        refused = await client.post("/v1/execute", json={"code": "print(1)"})
        assert refused.status_code == 503
        assert "unsafe_local" in refused.json()["detail"]
        scored = await client.post("/v1/score", json={"items": [
            {"id": "c", "completion": "```python\ndef f(): return 1\n```",
             "spec": {"type": "python_tests", "tests": ["assert f() == 1"]}},
            {"id": "e", "completion": "<answer>4</answer>", "spec": {"type": "exact", "answer": "4"}},
        ]})
        results = scored.json()["results"]
        assert results[0]["status"] == "sandbox_error" and results[0]["reward"] is None
        assert results[1] == {"id": "e", "reward": 1.0, "status": "ok", "detail": "", "components": {},
                              "logged": {}}


async def test_unsafe_local_runs_code_when_asked(reward_app):
    async with reward_app(sandbox="none", unsafe_local=True) as (app, client):
        assert "UNSAFE" in app.state.sandbox_description
        result = (await client.post("/v1/execute", json={"code": "print(6*7)"})).json()
        assert result["status"] == "ok" and result["stdout"] == "42\n"
