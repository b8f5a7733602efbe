"""Control plane: auth and prompt-set uploads, against real Redis.

Every refused request is checked to leave the database exactly as it was.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.fixtures.control import (
    ARITH_LINES,
    BODY_LIMIT,
    PROMPT_SET_LIMIT,
    READ_TOKEN,
    TOKEN,
    WRITE_TOKEN,
)

# -- auth ------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
async def test_401_without_a_valid_token(control, snapshot, headers):
    before = await snapshot(control.redis)
    for method, path in [("GET", "/v1/runs"), ("POST", "/v1/prompt-sets"), ("GET", "/"), ("POST", "/v1/runs")]:
        r = await control.client.request(method, path, headers=headers, content=b'{"prompt": "x"}')
        assert r.status_code == 401, (method, path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert await snapshot(control.redis) == before
    assert (await control.client.get("/healthz")).status_code == 200  # the one public route


async def test_403_for_a_token_without_the_scope(control, snapshot):
    before = await snapshot(control.redis)
    r = await control.upload(ARITH_LINES, token=READ_TOKEN)
    assert r.status_code == 403 and "'submit' scope" in r.json()["detail"]
    r = await control.client.post("/v1/runs/x/stop", headers=control.auth(READ_TOKEN))
    assert r.status_code == 403
    r = await control.client.get("/v1/runs", headers=control.auth(WRITE_TOKEN))
    assert r.status_code == 403 and "'read' scope" in r.json()["detail"]
    assert await snapshot(control.redis) == before
    # the read token reads, the write token writes, the main token does both
    assert (await control.client.get("/v1/runs", headers=control.auth(READ_TOKEN))).status_code == 200
    assert (await control.upload(ARITH_LINES, token=WRITE_TOKEN)).status_code == 201
    assert (await control.client.get("/v1/runs", headers=control.auth(TOKEN))).status_code == 200


async def test_browser_session_cookie_reads_but_cannot_write(control):
    r = await control.client.get("/?token=wrong")
    assert r.status_code == 401
    r = await control.client.get(f"/?token={READ_TOKEN}&run=abc")
    assert r.status_code == 303 and r.headers["location"] == "/?run=abc"  # the token leaves the URL
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and READ_TOKEN not in cookie
    session = cookie.split(";")[0]
    page = await control.client.get("/?run=abc", headers={"Cookie": session})
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert (await control.client.get("/v1/runs", headers={"Cookie": session})).status_code == 200
    forged = await control.client.post("/v1/prompt-sets", headers={"Cookie": session}, content=b"{}")
    assert forged.status_code == 401  # a cookie never authorizes a write
    bad = await control.client.get("/v1/runs", headers={"Cookie": "tandem_session=00ff"})
    assert bad.status_code == 401
    assert (await control.client.get(f"/?token={WRITE_TOKEN}")).status_code == 403  # no read scope


async def test_openapi_documents_every_route(control):
    assert (await control.client.get("/openapi.json")).status_code == 401
    paths = (await control.client.get("/openapi.json", headers=control.auth())).json()["paths"]
    assert set(paths) == {
        "/v1/prompt-sets", "/v1/prompt-sets/{set_id}", "/v1/runs", "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/metrics", "/v1/runs/{run_id}/completions", "/v1/runs/{run_id}/stop",
    }
    assert "application/x-ndjson" in paths["/v1/prompt-sets"]["post"]["requestBody"]["content"]


# -- uploads ---------------------------------------------------------------


async def test_upload_stores_the_lines_and_is_idempotent(control):
    r = await control.upload(ARITH_LINES)
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["count"] == len(ARITH_LINES) and info["reward_types"] == {"exact": 5}
    meta = await control.client.get(f"/v1/prompt-sets/{info['id']}", headers=control.auth())
    assert meta.status_code == 200 and meta.json()["count"] == 5
    again = await control.upload(ARITH_LINES)
    assert again.json()["id"] == info["id"]
    lines = await control.app.state.prompt_sets.lines(info["id"])
    assert len(lines) == 5  # stored once, not twice
    assert lines[0]["prompt"] == "12+30=" and lines[0]["spec"]["answer"] == "42"
    missing = await control.client.get("/v1/prompt-sets/ps-nope", headers=control.auth())
    assert missing.status_code == 404


async def test_untyped_lines_are_checked_against_the_default_type(control):
    r = await control.upload([{"prompt": "1+1=", "answer": "2"}])
    assert r.status_code == 201 and r.json()["reward_types"] == {"default": 1}
    r = await control.client.post(
        "/v1/prompt-sets?default_type=nope", content=b'{"prompt": "a", "answer": "2"}', headers=control.auth()
    )
    assert r.status_code == 422 and "default_type" in r.json()["detail"]


BAD_UPLOADS = {
    "missing field": (
        [ARITH_LINES[0], ARITH_LINES[1], {"prompt": "1+2=", "type": "exact"}],
        "line 3: answer: Field required",
    ),
    "missing prompt": ([{"type": "exact", "answer": "3"}], "line 1: prompt: field required"),
    "wrong types": (
        [ARITH_LINES[0], {"prompt": 5, "type": "numeric", "answer": "three"}],
        "line 2: prompt: must be a non-empty string",
    ),
    "wrong spec type": ([{"prompt": "x", "type": "numeric", "answer": "three"}], "line 1: answer: Input should be a valid number"),
    "unknown reward type": ([{"prompt": "x", "type": "telepathy", "answer": "1"}], "line 1: type: unknown reward type"),
    "unknown spec field": ([{"prompt": "x", "type": "exact", "answer": "1", "answr": 2}], "line 1: answr: unknown field"),
    "not an object": (b'["prompt", "x"]\n', "line 1: expected a JSON object"),
    "invalid JSON": (b'{"prompt": "x", "type": "exact", "answer": "1"}\n{"prompt": \n', "line 2: invalid JSON"),
    "empty file": (b"", "empty"),
    "blank lines only": (b"\n  \n\r\n", "empty"),
    "non-UTF-8": (b'{"prompt": "ok", "type": "exact", "answer": "1"}\n{"prompt": "\xff\xfe", "type": "exact", "answer": "1"}\n', "line 2: not valid UTF-8"),
    "latin-1 file": ('{"prompt": "café", "type": "exact", "answer": "1"}\n'.encode("latin-1"), "line 1: not valid UTF-8"),
}


@pytest.mark.parametrize("body, message", BAD_UPLOADS.values(), ids=BAD_UPLOADS.keys())
async def test_bad_upload_is_422_naming_the_line_and_stores_nothing(control, snapshot, body, message):
    await control.upload(ARITH_LINES[:2])  # something stored before, which must stay as it is
    before = await snapshot(control.redis)
    r = await control.upload(body)
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"], r.json()
    assert await snapshot(control.redis) == before


async def test_many_bad_lines_are_listed(control):
    body = b"".join(json.dumps({"prompt": f"p{i}", "type": "exact"}).encode() + b"\n" for i in range(50))
    r = await control.upload(body)
    assert r.status_code == 422
    errors = r.json()["errors"]
    assert len(errors) == 20 and errors[0] == {"line": 1, "field": "answer", "msg": "Field required"}
    assert errors[-1]["line"] == 20


async def test_wrong_content_type_or_encoding_is_415(control, snapshot):
    before = await snapshot(control.redis)
    r = await control.client.post(
        "/v1/prompt-sets", content=b"x", headers={**control.auth(), "Content-Type": "image/png"}
    )
    assert r.status_code == 415
    gzip = {**control.auth(), "Content-Type": "application/x-ndjson", "Content-Encoding": "gzip"}
    r = await control.client.post("/v1/prompt-sets", content=b"\x1f\x8b", headers=gzip)
    assert r.status_code == 415
    assert await snapshot(control.redis) == before


async def test_over_the_limit_by_content_length_is_413_before_the_body_is_read(serve_control, snapshot, control):
    """A real server, a raw socket: headers announce 1 GB; the answer comes after a few bytes of body."""
    before = await snapshot(control.redis)
    async with serve_control() as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/prompt-sets HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/x-ndjson\r\nContent-Length: {1 << 30}\r\n\r\n".encode()
        )
        writer.write(b'{"prompt": "x", ' * 64)
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert f"over {PROMPT_SET_LIMIT} bytes".encode() in head
    assert await snapshot(control.redis) == before


async def test_streamed_1gb_upload_is_413_after_reading_only_the_limit(control, snapshot):
    """No Content-Length (chunked): the body is counted as it streams and refused past the limit."""
    before = await snapshot(control.redis)
    sent = 0
    line = json.dumps(ARITH_LINES[0]).encode() + b"\n"
    chunk = line * (65536 // len(line))

    async def one_gigabyte():
        nonlocal sent
        while sent < 1 << 30:
            sent += len(chunk)
            yield chunk

    r = await control.client.post("/v1/prompt-sets", content=one_gigabyte(), headers=control.auth())
    assert r.status_code == 413, r.text
    assert sent <= PROMPT_SET_LIMIT + 2 * len(chunk)  # stopped reading at the limit, never buffered 1 GB
    assert await snapshot(control.redis) == before


async def test_prompt_sets_may_exceed_the_general_body_limit_but_other_routes_may_not(control):
    line = json.dumps(ARITH_LINES[0]).encode() + b"\n"
    body = line * (BODY_LIMIT * 2 // len(line))
    assert BODY_LIMIT < len(body) < PROMPT_SET_LIMIT
    assert (await control.upload(body)).status_code == 201
    big = b"{" + b" " * BODY_LIMIT + b"}"
    r = await control.client.post("/v1/runs", content=big, headers={**control.auth(), "Content-Type": "application/json"})
    assert r.status_code == 413


async def test_stored_prompt_sets_and_runs_survive_a_redis_crash(tmp_path):
    """AOF: kill -9 the Redis, start another on the same directory, everything acknowledged is there."""
    import httpx

    from broker.embedded import EmbeddedRedis
    from control_plane import build_app
    from tests.fixtures.control import control_settings, run_config

    async def client_of(url):
        app = build_app(control_settings(url, tmp_path))
        return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://control")

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        app, client = await client_of(server.url)
        async with app.router.lifespan_context(app), client:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            body = "\n".join(json.dumps(x) for x in ARITH_LINES)
            set_id = (await client.post("/v1/prompt-sets", content=body, headers=auth)).json()["id"]
            run = await client.post("/v1/runs", json={"prompt_set_id": set_id, "config": run_config()}, headers=auth)
            run_id = run.json()["run_id"]
        server.kill()
        server = EmbeddedRedis(tmp_path / "redis").start()
        app, client = await client_of(server.url)
        async with app.router.lifespan_context(app), client:
            assert (await client.get(f"/v1/prompt-sets/{set_id}", headers=auth)).json()["count"] == len(ARITH_LINES)
            status = (await client.get(f"/v1/runs/{run_id}", headers=auth)).json()
            assert status["run"]["state"] == "queued" and status["staleness"]["backlog"] == 2 * len(ARITH_LINES)
    finally:
        server.stop()
