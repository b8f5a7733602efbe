"""The service edge (``services.app``) with the control plane's extensions: scopes, cookie, per-path limits.

Every service shares this edge, so the single-token behaviour the other
services rely on is pinned here too.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi import Request

from control_plane.settings import ControlSettings
from services.app import create_app
from services.security import CLIENT_HEADER, owner_id, principal_of, session_cookie_value

# services.settings.MIN_TOKEN_CHARS: 16
SECRET = "edge-test-secret-token"
VIEWER = "edge-test-viewer-token"
WRITER = "edge-test-writer-token"
OPS = "edge-test-operator-token"
SUBMITTER = "edge-test-submitter-token"
OPENAI = "edge-test-openai-key-token"


def client_for(settings: ControlSettings, base_url: str = "http://edge", **kw) -> httpx.AsyncClient:
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

    for method, route in ROUTES:  # routes that services.security.ROUTE_SCOPES names
        app.add_api_route(route, _who, methods=[method])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)


ROUTES = [("POST", "/v1/runs/{run_id}/stop"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]


async def _who(request: Request) -> dict:
    who = principal_of(request)
    return {"owner": who.owner, "scopes": sorted(who.scopes)}


async def test_single_token_behaviour_is_unchanged():
    async with client_for(ControlSettings(token=SECRET)) as c:
        r = await c.get("/thing")
        assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token")
        r = await c.get("/thing", headers={"Authorization": "Bearer nope"})
        assert (r.status_code, r.json()["detail"]) == (401, "invalid bearer token")
        for method in ("GET", "POST"):
            r = await c.request(method, "/thing", headers={"Authorization": f"Bearer {SECRET}"})
            assert r.status_code == 200
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get(f"/thing?token={SECRET}")).status_code == 401  # no cookie login unless asked for


async def test_no_token_on_loopback_means_auth_off():
    async with client_for(ControlSettings(), base_url="http://127.0.0.1:8000") as c:
        assert (await c.post("/thing", json={})).status_code == 200
        assert (await c.post("/thing", headers={CLIENT_HEADER: "x"})).status_code == 200


def test_scoped_tokens_come_from_the_environment_and_count_as_auth(monkeypatch):
    monkeypatch.setenv("TANDEM_TOKENS", json.dumps({VIEWER: ["read"], OPS: ["read", "write"]}))
    settings = ControlSettings(host="0.0.0.0")
    assert settings.tokens == {VIEWER: ["read"], OPS: ["read", "write"]}
    settings.check_auth_safe()  # scoped tokens alone are auth: listening beyond loopback is allowed
    assert VIEWER not in repr(settings)
    monkeypatch.setenv("TANDEM_TOKENS", json.dumps({VIEWER: ["owner"]}))
    with pytest.raises(ValueError, match="TANDEM_TOKENS"):
        ControlSettings()


async def test_scopes_by_route():
    """Each token opens the routes of its scopes and no other (``services.security.ROUTE_SCOPES``); the
    OpenAI-compatible endpoint's key opens inference only."""
    settings = ControlSettings(token=SECRET, tokens={VIEWER: ["read"], WRITER: ["write"], SUBMITTER: ["read", "submit"],
                                                     OPS: ["admin"]}, openai_token=OPENAI)
    routes = {"GET /thing": ("get", "/thing"), "POST /thing": ("post", "/thing"),
              "stop": ("post", "/v1/runs/r1/stop"), "chat": ("post", "/v1/chat/completions"),
              "models": ("get", "/v1/models")}
    opens = {  # token -> the routes it opens; every other route answers 403 naming the scope it lacks
        VIEWER: {"GET /thing", "models"},
        SUBMITTER: {"GET /thing", "models", "stop"},
        WRITER: {"stop", "chat", "models"},  # the old "write": submit and infer, no longer admin
        OPENAI: {"chat", "models"},
        OPS: set(routes),
        SECRET: set(routes),
    }
    async with client_for(settings) as c:
        for token, opened in opens.items():
            for name, (method, path) in routes.items():
                r = await c.request(method, path, headers={"Authorization": f"Bearer {token}"})
                assert r.status_code == (200 if name in opened else 403), (token, name, r.text)
        r = await c.post("/thing", headers={"Authorization": f"Bearer {VIEWER}"})
        assert (r.status_code, r.json()["detail"]) == (403, "this token lacks the 'admin' scope")
        r = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {SUBMITTER}"})
        assert (r.status_code, r.json()["detail"]) == (403, "this token lacks the 'infer' scope")
        r = await c.post("/v1/runs/r1/stop", headers={"Authorization": f"Bearer {OPENAI}"})
        assert (r.status_code, r.json()["detail"]) == (403, "this token lacks the 'submit' scope")
        # each token is its own owner, recorded as a digest, never the token
        seen = {t: (await c.get("/v1/models", headers={"Authorization": f"Bearer {t}"})).json() for t in (SECRET, OPENAI)}
        assert seen[SECRET]["scopes"] == ["admin", "infer", "read", "submit"] and seen[OPENAI]["scopes"] == ["infer"]
        assert seen[SECRET]["owner"] == owner_id(SECRET) != owner_id(OPENAI) == seen[OPENAI]["owner"]
        assert SECRET not in json.dumps(seen[SECRET]) and OPENAI not in json.dumps(seen[OPENAI])
        assert (await c.get("/thing")).status_code == 401


async def test_session_cookie_is_derived_not_the_token_and_read_only():
    async with client_for(ControlSettings(token=SECRET), cookie_login_path="/thing") as c:
        r = await c.get(f"/thing?token={SECRET}&x=1")
        assert r.status_code == 303 and r.headers["location"] == "/thing?x=1"
        value = r.cookies["tandem_session"]
        issued, _, _ = value.partition(".")
        assert value == session_cookie_value(SECRET, int(issued)) and abs(int(issued) - time.time()) < 5
        assert SECRET not in r.headers["set-cookie"]
        cookie = {"Cookie": f"other=1; tandem_session={value}"}
        assert (await c.get("/thing", headers=cookie)).status_code == 200
        assert (await c.post("/thing", headers=cookie)).status_code == 401
        # the cookie is not a bearer token
        assert (await c.get("/thing", headers={"Authorization": f"Bearer {value}"})).status_code == 401


async def test_per_path_body_limits():
    settings = ControlSettings(token=SECRET, max_body_bytes=1024)
    auth = {"Authorization": f"Bearer {SECRET}"}
    async with client_for(settings, body_limits={"/upload": 4096}) as c:
        assert (await c.post("/upload", content=b"x" * 3000, headers=auth)).json() == {"bytes": 3000}
        assert (await c.post("/upload", content=b"x" * 5000, headers=auth)).status_code == 413
        assert (await c.post("/thing", content=b"x" * 3000, headers=auth)).status_code == 413


async def test_auth_is_one_security_dependency_on_every_route_a_service_adds():
    from fastapi import APIRouter

    settings = ControlSettings(token=SECRET, tokens={VIEWER: ["read"]})
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
        assert (await c.get("/openapi.json", headers={"Authorization": f"Bearer {SECRET}"})).status_code == 200
        # the scheme is case-insensitive and padding around the token is ignored, as before
        assert (await c.get("/v1/later", headers={"Authorization": f"bearer   {VIEWER} "})).status_code == 200
        r = await c.get("/v1/later", headers={"Authorization": "Basic c2VjcmV0"})
        assert (r.status_code, r.json()) == (401, {"detail": "missing bearer token"})


async def test_cookie_login_refusals_and_bad_cookies():
    settings = ControlSettings(token=SECRET, tokens={WRITER: ["write"]})
    async with client_for(settings, cookie_login_path="/thing") as c:
        r = await c.get("/thing?token=nope")
        assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (401, {"detail": "invalid token"}, "Bearer")
        r = await c.get(f"/thing?token={WRITER}")
        assert (r.status_code, r.json()) == (403, {"detail": "this token lacks the 'read' scope"})
        assert "set-cookie" not in r.headers
        assert (await c.post(f"/thing?token={SECRET}")).status_code == 401  # login is GET only
        r = await c.get("/thing", headers={"Cookie": "tandem_session=00ff"})
        assert (r.status_code, r.json()) == (401, {"detail": "invalid session cookie"})
        # the writer's derived cookie reads nothing: a cookie only ever carries 'read'
        writer_cookie = {"Cookie": f"tandem_session={session_cookie_value(WRITER, int(time.time()))}"}
        assert (await c.get("/thing", headers=writer_cookie)).status_code == 403
        # a bearer beside a cookie is what counts
        both = {"Cookie": f"tandem_session={session_cookie_value(SECRET, int(time.time()))}", "Authorization": "Bearer nope"}
        assert (await c.get("/thing", headers=both)).status_code == 401


# -- start-up refusals, Host allow-list, cross-site writes, cookie expiry (issue 12) ------------


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"token": "", "host": "0.0.0.0"}, "TANDEM_TOKEN"),  # once: auth off on a public bind
        ({"token": ""}, "TANDEM_TOKEN"),
        ({"token": "fifteen-chars!!"}, "TANDEM_TOKEN"),
        ({"token": SECRET, "tokens": {"short": ["read"]}}, "TANDEM_TOKENS"),
    ],
)
def test_empty_or_short_tokens_stop_the_start(kw, names):
    with pytest.raises(ValueError, match=names):
        create_app("edge-test", ControlSettings(**kw))


def test_an_empty_token_from_the_environment_is_no_token(monkeypatch):
    monkeypatch.setenv("TANDEM_TOKEN", "")
    settings = ControlSettings(host="0.0.0.0")
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        settings.check_auth_safe()


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("127.0.0.1:8000", 200), ("localhost:9", 200), ("[::1]:8000", 200), ("localhost", 200),
        ("evil.example:8000", 403), ("evil.example", 403), ("127.0.0.1.evil.example:8000", 403),
        ("localhost.evil.example", 403), ("", 403),
    ],
)
async def test_auth_off_answers_loopback_host_names_only(host, status):
    async with client_for(ControlSettings(), base_url="http://127.0.0.1:8000") as c:
        r = await c.get("/thing", headers={"Host": host})
        assert r.status_code == status, r.text
        if status == 403:
            assert "Host" in r.json()["detail"]
        assert (await c.get("/healthz", headers={"Host": host})).status_code == 200  # probes use pod IPs


async def test_auth_off_answers_its_own_loopback_bind_address():
    async with client_for(ControlSettings(host="127.0.0.2"), base_url="http://127.0.0.2:8000") as c:
        assert (await c.get("/thing")).status_code == 200
        assert (await c.get("/thing", headers={"Host": "127.0.0.3:8000"})).status_code == 403


async def test_configured_hosts_are_checked_with_auth_on_too():
    auth = {"Authorization": f"Bearer {SECRET}"}
    async with client_for(ControlSettings(token=SECRET), base_url="http://anything.example") as c:
        assert (await c.get("/thing", headers=auth)).status_code == 200  # unset: a rebound page has no token
    settings = ControlSettings(token=SECRET, allowed_hosts=["tandem.example", "proxy.example:443"])
    async with client_for(settings, base_url="http://tandem.example:8000") as c:
        assert (await c.get("/thing", headers=auth)).status_code == 200
        assert (await c.get("/thing", headers={**auth, "Host": "proxy.example:443"})).status_code == 200
        assert (await c.get("/thing", headers={**auth, "Host": "proxy.example:8000"})).status_code == 403
        assert (await c.get("/thing", headers={**auth, "Host": "localhost:8000"})).status_code == 403


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 403),  # a body-less POST (a page's fetch(url, {method: "POST", mode: "no-cors"}))
        ({"Content-Type": "text/plain"}, 403),
        ({"Content-Type": "text/plain;charset=UTF-8"}, 403),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 403),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 403),
        ({"Content-Type": "application/json"}, 200),
        ({"Content-Type": "application/x-ndjson"}, 200),
        ({"Content-Type": "text/plain", CLIENT_HEADER: "tandem"}, 200),
    ],
)
async def test_auth_off_refuses_writes_a_web_page_could_send_without_preflight(headers, status):
    async with client_for(ControlSettings(), base_url="http://localhost:8000") as c:
        r = await c.post("/upload", content=b"{}", headers=headers)
        assert r.status_code == status, r.text
        if status == 403:
            assert CLIENT_HEADER in r.json()["detail"] and "Content-Type" in r.json()["detail"]
    # with auth on the bearer is what counts (a page cannot attach it): text/plain is fine
    async with client_for(ControlSettings(token=SECRET)) as c:
        r = await c.post("/upload", content=b"{}", headers={**headers, "Authorization": f"Bearer {SECRET}"})
        assert r.status_code == 200, r.text


async def test_session_cookie_expires_and_is_strict():
    settings = ControlSettings(token=SECRET, session_max_age_s=600)
    async with client_for(settings, cookie_login_path="/thing", session_max_age_s=600) as c:
        r = await c.get(f"/thing?token={SECRET}")
        set_cookie = r.headers["set-cookie"].lower()
        for part in ("max-age=600", "httponly", "samesite=strict", "path=/"):
            assert part in set_cookie, set_cookie
        fresh = session_cookie_value(SECRET, int(time.time()) - 590)
        assert (await c.get("/thing", headers={"Cookie": f"tandem_session={fresh}"})).status_code == 200
        # the browser's Max-Age is not the only limit: the server checks the age it signed
        old = session_cookie_value(SECRET, int(time.time()) - 610)
        r = await c.get("/thing", headers={"Cookie": f"tandem_session={old}"})
        assert (r.status_code, r.json()["detail"]) == (401, "session cookie expired: sign in again with ?token=")
        future = session_cookie_value(SECRET, int(time.time()) + 3600)
        assert (await c.get("/thing", headers={"Cookie": f"tandem_session={future}"})).status_code == 401
        # the issue time is signed: a fresh time on an old MAC is refused
        forged = f"{int(time.time())}.{old.partition('.')[2]}"
        assert (await c.get("/thing", headers={"Cookie": f"tandem_session={forged}"})).status_code == 401


async def test_only_the_app_that_issues_the_cookie_accepts_it():
    """Browsers send a host's cookies to every port: the control plane's cookie must not open the others."""
    cookie = {"Cookie": f"tandem_session={session_cookie_value(SECRET, int(time.time()))}"}
    async with client_for(ControlSettings(token=SECRET)) as c:  # no cookie_login_path: another service
        r = await c.get("/thing", headers=cookie)
        assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token")
    async with client_for(ControlSettings(token=SECRET), cookie_login_path="/thing") as c:
        assert (await c.get("/thing", headers=cookie)).status_code == 200
