"""The service edge (``services.app``) with the control plane's extensions: scopes, cookie, per-path limits.

Every service shares this edge, so the single-token behaviour the other
services rely on is pinned here too.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import Request

from services.app import create_app, session_cookie_value
from services.settings import ServiceSettings


def client_for(settings: ServiceSettings, **kw) -> httpx.AsyncClient:
    app = create_app("edge-test", settings, **kw)

    @app.get("/thing")
    async def _get() -> dict:
        return {"ok": True}

    @app.post("/thing")
    async def _post() -> dict:
        return {"ok": True}

    @app.post("/upload")
    async def _upload(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge")


async def test_single_token_behaviour_is_unchanged():
    async with client_for(ServiceSettings(token="secret")) as c:
        r = await c.get("/thing")
        assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token")
        r = await c.get("/thing", headers={"Authorization": "Bearer nope"})
        assert (r.status_code, r.json()["detail"]) == (401, "invalid bearer token")
        for method in ("GET", "POST"):
            r = await c.request(method, "/thing", headers={"Authorization": "Bearer secret"})
            assert r.status_code == 200
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/?token=secret")).status_code == 401  # no cookie login unless asked for


async def test_no_token_on_loopback_means_auth_off():
    async with client_for(ServiceSettings()) as c:
        assert (await c.post("/thing")).status_code == 200


def test_scoped_tokens_come_from_the_environment_and_count_as_auth(monkeypatch):
    monkeypatch.setenv("TANDEM_TOKENS", '{"viewer": ["read"], "ops": ["read", "write"]}')
    settings = ServiceSettings(host="0.0.0.0")
    assert settings.tokens == {"viewer": ["read"], "ops": ["read", "write"]}
    settings.check_auth_safe()  # scoped tokens alone are auth: listening beyond loopback is allowed
    assert "viewer" not in repr(settings)
    monkeypatch.setenv("TANDEM_TOKENS", '{"viewer": ["admin"]}')
    with pytest.raises(ValueError, match="tokens"):
        ServiceSettings()


async def test_scopes_by_method():
    settings = ServiceSettings(tokens={"viewer": ["read"], "writer": ["write"]})
    async with client_for(settings) as c:
        viewer, writer = ({"Authorization": f"Bearer {t}"} for t in ("viewer", "writer"))
        assert (await c.get("/thing", headers=viewer)).status_code == 200
        r = await c.post("/thing", headers=viewer)
        assert (r.status_code, r.json()["detail"]) == (403, "this token lacks the 'write' scope")
        assert (await c.post("/thing", headers=writer)).status_code == 200
        assert (await c.get("/thing", headers=writer)).status_code == 403
        assert (await c.get("/thing")).status_code == 401


async def test_session_cookie_is_derived_not_the_token_and_read_only():
    async with client_for(ServiceSettings(token="secret"), cookie_login_path="/thing") as c:
        r = await c.get("/thing?token=secret&x=1")
        assert r.status_code == 303 and r.headers["location"] == "/thing?x=1"
        value = session_cookie_value("secret")
        assert f"tandem_session={value};" in r.headers["set-cookie"] and "secret" not in r.headers["set-cookie"]
        cookie = {"Cookie": f"other=1; tandem_session={value}"}
        assert (await c.get("/thing", headers=cookie)).status_code == 200
        assert (await c.post("/thing", headers=cookie)).status_code == 401
        # the cookie is not a bearer token
        assert (await c.get("/thing", headers={"Authorization": f"Bearer {value}"})).status_code == 401


async def test_per_path_body_limits():
    settings = ServiceSettings(token="secret", max_body_bytes=1024)
    auth = {"Authorization": "Bearer secret"}
    async with client_for(settings, body_limits={"/upload": 4096}) as c:
        assert (await c.post("/upload", content=b"x" * 3000, headers=auth)).json() == {"bytes": 3000}
        assert (await c.post("/upload", content=b"x" * 5000, headers=auth)).status_code == 413
        assert (await c.post("/thing", content=b"x" * 3000, headers=auth)).status_code == 413
