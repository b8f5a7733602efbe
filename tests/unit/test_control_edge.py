"""The service edge (``services.app``) with the control plane's extensions: scopes, cookie, per-path limits.

Every service shares this edge, so the single-token behaviour the other
services rely on is pinned here too.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import Request

from services.app import create_app, session_cookie_value
from services.settings import ControlSettings


def client_for(settings: ControlSettings, **kw) -> httpx.AsyncClient:
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
    async with client_for(ControlSettings(token="secret")) as c:
        r = await c.get("/thing")
        assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token")
        r = await c.get("/thing", headers={"Authorization": "Bearer nope"})
        assert (r.status_code, r.json()["detail"]) == (401, "invalid bearer token")
        for method in ("GET", "POST"):
            r = await c.request(method, "/thing", headers={"Authorization": "Bearer secret"})
            assert r.status_code == 200
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/thing?token=secret")).status_code == 401  # no cookie login unless asked for


async def test_no_token_on_loopback_means_auth_off():
    async with client_for(ControlSettings()) as c:
        assert (await c.post("/thing")).status_code == 200


def test_scoped_tokens_come_from_the_environment_and_count_as_auth(monkeypatch):
    monkeypatch.setenv("TANDEM_TOKENS", '{"viewer": ["read"], "ops": ["read", "write"]}')
    settings = ControlSettings(host="0.0.0.0")
    assert settings.tokens == {"viewer": ["read"], "ops": ["read", "write"]}
    settings.check_auth_safe()  # scoped tokens alone are auth: listening beyond loopback is allowed
    assert "viewer" not in repr(settings)
    monkeypatch.setenv("TANDEM_TOKENS", '{"viewer": ["admin"]}')
    with pytest.raises(ValueError, match="TANDEM_TOKENS"):
        ControlSettings()


async def test_scopes_by_method():
    settings = ControlSettings(tokens={"viewer": ["read"], "writer": ["write"]})
    async with client_for(settings) as c:
        viewer, writer = ({"Authorization": f"Bearer {t}"} for t in ("viewer", "writer"))
        assert (await c.get("/thing", headers=viewer)).status_code == 200
        r = await c.post("/thing", headers=viewer)
        assert (r.status_code, r.json()["detail"]) == (403, "this token lacks the 'write' scope")
        assert (await c.post("/thing", headers=writer)).status_code == 200
        assert (await c.get("/thing", headers=writer)).status_code == 403
        assert (await c.get("/thing")).status_code == 401


async def test_session_cookie_is_derived_not_the_token_and_read_only():
    async with client_for(ControlSettings(token="secret"), cookie_login_path="/thing") as c:
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
    settings = ControlSettings(token="secret", max_body_bytes=1024)
    auth = {"Authorization": "Bearer secret"}
    async with client_for(settings, body_limits={"/upload": 4096}) as c:
        assert (await c.post("/upload", content=b"x" * 3000, headers=auth)).json() == {"bytes": 3000}
        assert (await c.post("/upload", content=b"x" * 5000, headers=auth)).status_code == 413
        assert (await c.post("/thing", content=b"x" * 3000, headers=auth)).status_code == 413


async def test_auth_is_one_security_dependency_on_every_route_a_service_adds():
    from fastapi import APIRouter

    settings = ControlSettings(token="secret", tokens={"viewer": ["read"]})
    app = create_app("edge-test", settings, cookie_login_path="/thing")
    router = APIRouter(prefix="/v1")

    @router.get("/later")
    async def _later() -> dict:
        return {"ok": True}

    app.include_router(router)  # as every service does, after create_app
    schemes = app.openapi()["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}
    assert [s.get("name") for s in schemes.values() if s["type"] == "apiKey"] == ["tandem_session"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as c:
        assert (await c.get("/v1/later")).status_code == 401
        for path in ("/openapi.json", "/docs", "/redoc", "/metrics"):
            r = await c.get(path)
            assert (r.status_code, r.headers["www-authenticate"]) == (401, "Bearer"), path
        assert (await c.get("/openapi.json", headers={"Authorization": "Bearer secret"})).status_code == 200
        # the scheme is case-insensitive and padding around the token is ignored, as before
        assert (await c.get("/v1/later", headers={"Authorization": "bearer   viewer "})).status_code == 200
        r = await c.get("/v1/later", headers={"Authorization": "Basic c2VjcmV0"})
        assert (r.status_code, r.json()) == (401, {"detail": "missing bearer token"})


async def test_cookie_login_refusals_and_bad_cookies():
    settings = ControlSettings(token="secret", tokens={"writer": ["write"]})
    async with client_for(settings, cookie_login_path="/thing") as c:
        r = await c.get("/thing?token=nope")
        assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (401, {"detail": "invalid token"}, "Bearer")
        r = await c.get("/thing?token=writer")
        assert (r.status_code, r.json()) == (403, {"detail": "this token lacks the 'read' scope"})
        assert "set-cookie" not in r.headers
        assert (await c.post("/thing?token=secret")).status_code == 401  # login is GET only
        r = await c.get("/thing", headers={"Cookie": "tandem_session=00ff"})
        assert (r.status_code, r.json()) == (401, {"detail": "invalid session cookie"})
        # the writer's derived cookie reads nothing: a cookie only ever carries 'read'
        writer_cookie = {"Cookie": f"tandem_session={session_cookie_value('writer')}"}
        assert (await c.get("/thing", headers=writer_cookie)).status_code == 403
        # a bearer beside a cookie is what counts
        both = {"Cookie": f"tandem_session={session_cookie_value('secret')}", "Authorization": "Bearer nope"}
        assert (await c.get("/thing", headers=both)).status_code == 401
