"""What a web page in the operator's browser, or a careless setting, can do to tandem's HTTP services.

Real control plane (real Redis, database of the control tests) and real reward
server, served by uvicorn on free ports and called over HTTP; the start-up
refusals through ``tandem serve``. Threats (docs/architecture.md section 7, "web
pages in the operator's browser"):

- ``TANDEM_TOKEN=""`` once passed the loopback guard and switched auth off;
- with auth off on loopback, a DNS-rebound page (Host: its own name) reached
  every route, and a page could POST a ``text/plain`` upload or a body-less
  stop without a CORS preflight;
- the control plane's session cookie is sent by the browser to every port of
  the host: only the control plane may accept it, and only while it is young.

The rollout server's ``POST /v1/weights`` cases need the session's vLLM engine
and live in ``tests/integration/rollout_server/test_http.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx
import pytest

from services.security import CLIENT_HEADER, session_cookie_value
from tests.fixtures.control import ARITH_LINES, NO_MODEL, READ_TOKEN, TOKEN, run_config
from tests.servers import uvicorn_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EVIL = "rebind.evil.example"


@pytest.fixture
def serve_open_control(control_db_url, control_redis, tmp_path):
    """``async with serve_open_control(**settings) as url``: a control plane with auth off on 127.0.0.1."""
    from control_plane import build_app
    from control_plane.settings import ControlSettings
    from host.processes import free_port

    @contextlib.asynccontextmanager
    async def serve(**kw):
        port = free_port()
        app = build_app(ControlSettings(redis_url=control_db_url, run_dir=tmp_path, port=port,
                                        model_dirs=[NO_MODEL], **kw))  # run_config()'s model, outside tmp_path
        async with uvicorn_server(app, port):
            yield f"http://127.0.0.1:{port}"

    return serve


@contextlib.asynccontextmanager
async def reward_server(**kw):
    from host.processes import free_port
    from reward_server import build_app
    from reward_server.settings import RewardSettings

    port = free_port()
    app = build_app(RewardSettings(sandbox="none", unsafe_local=False, workers=1, math_workers=1, port=port, **kw))
    async with uvicorn_server(app, port):
        yield f"http://127.0.0.1:{port}"


def _ndjson(lines: list[dict]) -> bytes:
    import json

    return "\n".join(json.dumps(x) for x in lines).encode() + b"\n"


# -- start-up ------------------------------------------------------------------------------


@pytest.mark.parametrize(("token", "host"), [("", "0.0.0.0"), ("", "127.0.0.1"), ("short-token", "127.0.0.1")])
def test_an_empty_or_short_token_stops_tandem_serve(token, host, control_db_url, tmp_path):
    from host.processes import free_port

    env = {**os.environ, "TANDEM_TOKEN": token, "REDIS_URL": control_db_url, "TANDEM_RUN_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "serve", "control", "--host", host, "--port", str(free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "TANDEM_TOKEN" in proc.stderr and "Uvicorn running" not in proc.stderr, proc.stderr[-2000:]


# -- auth off on loopback: DNS rebinding and cross-site writes ------------------------------


async def test_a_dns_rebound_page_gets_403_from_every_route(serve_open_control, control_redis, snapshot):
    async with serve_open_control() as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        port = url.rsplit(":", 1)[1]
        assert (await c.get("/v1/runs")).status_code == 200  # Host: 127.0.0.1:port
        assert (await c.get("/v1/runs", headers={"Host": f"localhost:{port}"})).status_code == 200
        before = await snapshot(control_redis)
        rebound = {"Host": f"{EVIL}:{port}"}
        for method, path, kw in [
            ("GET", "/v1/runs", {}),
            ("GET", "/", {}),
            ("GET", "/metrics", {}),
            ("GET", "/openapi.json", {}),
            ("POST", "/v1/prompt-sets", {"content": _ndjson(ARITH_LINES),
                                         "headers": {"Content-Type": "application/x-ndjson"}}),
            ("POST", "/v1/runs", {"json": {"prompt_set_id": "x", "config": run_config()}}),
        ]:
            headers = {**kw.pop("headers", {}), **rebound}
            r = await c.request(method, path, **kw, headers=headers)
            assert r.status_code == 403 and "Host" in r.json()["detail"], (method, path, r.text)
        assert await snapshot(control_redis) == before
        assert (await c.get("/healthz", headers=rebound)).status_code == 200  # probes are not refused


async def test_a_page_cannot_upload_or_stop_without_a_preflight(serve_open_control, control_redis, snapshot):
    from services.clients import ControlClient

    async with serve_open_control() as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        before = await snapshot(control_redis)
        body = _ndjson(ARITH_LINES)
        for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=b"):
            r = await c.post("/v1/prompt-sets", content=body, headers={"Content-Type": content_type})
            assert r.status_code == 403, (content_type, r.text)
            assert "Content-Type" in r.json()["detail"] and CLIENT_HEADER in r.json()["detail"]
        assert await snapshot(control_redis) == before  # nothing stored

        # tandem's own client (what `tandem submit` uses) keeps working without a token
        async with ControlClient(url) as control:
            info = await control.upload_prompt_set(body, "exact")
            created = await control.create_run(info.id, run_config())
            r = await c.post(f"/v1/runs/{created.run_id}/stop")  # a page's body-less POST
            assert r.status_code == 403, r.text
            assert (await control.run_status(created.run_id)).run.state == "queued"
            stopped = await control.stop_run(created.run_id)  # body-less too, with the client header
            assert stopped.state == "stopped"
        # a client that sends text/plain may say who it is
        r = await c.post("/v1/prompt-sets", content=body, headers={"Content-Type": "text/plain", CLIENT_HEADER: "x"})
        assert r.status_code == 201, r.text


async def test_the_reward_server_without_auth_refuses_rebound_pages_and_simple_posts():
    items = {"items": [{"id": "a", "completion": "4", "spec": {"type": "exact", "answer": "4"}}]}
    async with reward_server() as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        port = url.rsplit(":", 1)[1]
        r = await c.post("/v1/score", json=items)
        assert r.status_code == 200, r.text
        r = await c.post("/v1/score", json=items, headers={"Host": f"{EVIL}:{port}"})
        assert r.status_code == 403 and "Host" in r.json()["detail"], r.text
        import json

        r = await c.post("/v1/score", content=json.dumps(items), headers={"Content-Type": "text/plain"})
        assert r.status_code == 403 and "Content-Type" in r.json()["detail"], r.text


# -- the session cookie -------------------------------------------------------------------


async def test_the_session_cookie_is_strict_expires_and_opens_only_the_control_plane(serve_control):
    tokens = {READ_TOKEN: ["read"]}
    async with serve_control(session_max_age_s=300) as url, reward_server(token=TOKEN, tokens=tokens) as reward:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.get(f"/?token={READ_TOKEN}")
            assert r.status_code == 303, r.text
            set_cookie = r.headers["set-cookie"].lower()
            for part in ("max-age=300", "httponly", "samesite=strict"):
                assert part in set_cookie, set_cookie
            cookie = {"Cookie": f"tandem_session={r.cookies['tandem_session']}"}
            assert (await c.get("/v1/runs", headers=cookie)).status_code == 200
            # a write is never authorized by the cookie
            assert (await c.post("/v1/runs", json={"prompt_set_id": "x"}, headers=cookie)).status_code == 401
            stale = session_cookie_value(READ_TOKEN, int(time.time()) - 301)
            r = await c.get("/v1/runs", headers={"Cookie": f"tandem_session={stale}"})
            assert r.status_code == 401 and "expired" in r.json()["detail"], r.text
        # the browser sends the host's cookies to the reward server's port too: it is refused there
        async with httpx.AsyncClient(base_url=reward, timeout=30) as c:
            r = await c.get("/metrics", headers=cookie)
            assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token")
            assert (await c.get("/metrics", headers={"Authorization": f"Bearer {READ_TOKEN}"})).status_code == 200
