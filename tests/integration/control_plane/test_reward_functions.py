"""The control plane asks a real reward server about the python reward functions a prompt set names:
refused at upload, or when the run is created, before anything is stored or enqueued."""

from __future__ import annotations

import contextlib
import uuid

import httpx
import pytest

from tests.fixtures.control import Control, control_settings, run_config
from tests.servers import uvicorn_server

REWARD_TOKEN = "reward-functions-test-token"


@pytest.fixture
def rewards_module(tmp_path, monkeypatch) -> str:
    name = f"cp_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def match(prompts, completions, solution, **kwargs):\n"
        "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward server's spawned workers inherit the path
    return name


@contextlib.asynccontextmanager
async def reward_server(functions: list[str], models: dict[str, str] | None = None):
    """A real reward server (its own lifespan, its own process pool) on a free port."""
    from host.processes import free_port
    from reward_server import build_app
    from reward_server.settings import RewardSettings

    port = free_port()
    app = build_app(RewardSettings(token=REWARD_TOKEN, sandbox="none", functions=functions, models=models or {}))
    async with uvicorn_server(app, port):
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def control_plane(db_url, redis, tmp_path, **settings):
    from control_plane import build_app

    app = build_app(control_settings(db_url, tmp_path, **settings))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://control") as client:
            yield Control(app, client, redis, None)


def line(i: int, function: str) -> dict:
    return {"prompt": f"{i}+1=", "type": "python", "function": function, "solution": str(i + 1)}


async def test_an_upload_naming_a_refused_function_is_refused_naming_it(
        rewards_module, control_db_url, control_redis, tmp_path, snapshot):
    m = rewards_module
    async with reward_server([f"{m}:*"]) as url, control_plane(
            control_db_url, control_redis, tmp_path, reward_url=url, reward_token=REWARD_TOKEN) as control:
        ok = await control.upload([line(0, f"{m}:match"), line(1, f"{m}:match")])
        assert ok.status_code == 201, ok.text
        before = await snapshot(control_redis)
        nested = {"prompt": "2+1=", "type": "combined", "parts": [
            {"weight": 1.0, "spec": {"type": "exact", "answer": "3"}},
            {"weight": 0.5, "spec": {"type": "python", "function": "os:system"}}]}
        resp = await control.upload([line(0, f"{m}:match"), line(1, f"{m}:nope"), nested, line(3, f"{m}:nope")])
        assert resp.status_code == 422, resp.text
        assert resp.json()["errors"] == [
            {"line": 2, "field": "function", "msg": f"module {m} has no 'nope'"},
            {"line": 3, "field": "parts.1.spec.function",
             "msg": f"os:system is not allowed by the reward server's TANDEM_REWARD_FUNCTIONS (allowed: {m}:*)"},
        ]
        assert "line 2: function: module" in resp.json()["detail"]
        assert await snapshot(control_redis) == before  # nothing stored


async def test_a_line_without_a_column_the_function_requires_is_refused_naming_the_parameter(
        rewards_module, control_db_url, control_redis, tmp_path, snapshot):
    """``match`` requires ``solution``: a line that gives none would fail on every call, so the upload is
    refused at that line, naming the parameter; the lines that give it pass (TRL's own keywords need none)."""
    m = rewards_module
    async with reward_server([f"{m}:*"]) as url, control_plane(
            control_db_url, control_redis, tmp_path, reward_url=url, reward_token=REWARD_TOKEN) as control:
        before = await snapshot(control_redis)
        bare = {"prompt": "2+1=", "type": "python", "function": f"{m}:match"}
        resp = await control.upload([line(0, f"{m}:match"), line(1, f"{m}:match"), bare, line(3, f"{m}:match")])
        assert resp.status_code == 422, resp.text
        (error,) = resp.json()["errors"]
        assert (error["line"], error["field"]) == (3, "function")
        assert "requires 'solution', which tandem does not pass" in error["msg"]
        assert await snapshot(control_redis) == before
        with_args = {"prompt": "2+1=", "type": "python", "function": f"{m}:match", "args": {"solution": "3"}}
        assert (await control.upload([line(0, f"{m}:match"), with_args])).status_code == 201


async def test_a_run_is_refused_before_anything_is_enqueued(
        rewards_module, control_db_url, control_redis, tmp_path, snapshot):
    """Sets uploaded where nothing was checked (no reward server configured) are checked when the run is
    created, the held-out set too: the reward server's allow-list is what counts then."""
    m = rewards_module
    async with control_plane(control_db_url, control_redis, tmp_path) as unchecked:
        train = (await unchecked.upload([line(0, f"{m}:match"), line(1, f"{m}:match")])).json()["id"]
        held_out = (await unchecked.upload([line(0, f"{m}:match"), line(1, f"{m}:other")])).json()["id"]
    async with reward_server([f"{m}:match"]) as url, control_plane(
            control_db_url, control_redis, tmp_path, reward_url=url, reward_token=REWARD_TOKEN) as control:
        before = await snapshot(control_redis)
        resp = await control.client.post("/v1/runs", headers=control.auth(), json={
            "prompt_set_id": train, "eval_prompt_set_id": held_out, "config": run_config()})
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"].startswith(f"eval_prompt_set_id: prompt set {held_out} under this config: "
                                                f"line 2: function: {m}:other is not allowed")
        assert await snapshot(control_redis) == before  # no run, no groups, no held-out prompts
        resp = await control.client.post("/v1/runs", headers=control.auth(), json={
            "prompt_set_id": train, "config": run_config()})
        assert resp.status_code == 201, resp.text


async def test_a_reward_model_the_reward_server_does_not_list_is_refused_at_the_door(
        rewards_module, control_db_url, control_redis, tmp_path, snapshot):
    """A ``reward_model`` spec names a model the reward server's operator lists (``TANDEM_REWARD_MODELS``):
    an unlisted name is refused at upload, naming its line and field, in a combined spec too, and a line
    that takes ``reward.type = "reward_model"`` is checked as such. The folder is never read by a check."""
    m = rewards_module
    async with reward_server([f"{m}:*"], {"even": str(tmp_path / "not-read")}) as url, control_plane(
            control_db_url, control_redis, tmp_path, reward_url=url, reward_token=REWARD_TOKEN) as control:
        judged = {"prompt": "1+1=", "type": "reward_model", "model": "even"}
        assert (await control.upload([judged, line(1, f"{m}:match")])).status_code == 201
        before = await snapshot(control_redis)
        nested = {"prompt": "2+1=", "type": "combined", "parts": [
            {"weight": 1.0, "spec": {"type": "exact", "answer": "3"}},
            {"weight": 0.5, "spec": {"type": "reward_model", "model": "helpful"}}]}
        resp = await control.upload([judged, {**judged, "model": "odd"}, nested])
        assert resp.status_code == 422, resp.text
        assert resp.json()["errors"] == [
            {"line": 2, "field": "model", "msg": "odd is not a reward model of this reward server's "
                                                 "TANDEM_REWARD_MODELS (listed: even)"},
            {"line": 3, "field": "parts.1.spec.model", "msg": "helpful is not a reward model of this reward "
                                                              "server's TANDEM_REWARD_MODELS (listed: even)"}]
        untyped = await control.client.post("/v1/prompt-sets", headers={**control.auth(), "Content-Type": "application/x-ndjson"},
                                            params={"default_type": "reward_model"},
                                            content=b'{"prompt": "1+1=", "model": "odd"}\n')
        assert untyped.status_code == 422 and "line 1: model: odd is not a reward model" in untyped.json()["detail"], \
            untyped.text
        assert await snapshot(control_redis) == before  # nothing stored


async def test_an_unreachable_reward_server_is_a_503_not_a_pass(rewards_module, control_db_url, control_redis, tmp_path):
    from host.processes import free_port

    async with control_plane(control_db_url, control_redis, tmp_path,
                             reward_url=f"http://127.0.0.1:{free_port()}") as control:
        resp = await control.upload([line(0, f"{rewards_module}:match")])
        assert resp.status_code == 503 and "cannot ask the reward server" in resp.json()["detail"]
        assert resp.headers["retry-after"]
        plain = await control.upload([{"prompt": "1+1=", "type": "exact", "answer": "2"}])
        assert plain.status_code == 201  # a set that names no function needs no reward server

