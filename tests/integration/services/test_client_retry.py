"""The client retry policy (services.clients) over real HTTP: 429 and 5xx are retried and the wait
honours ``Retry-After``; any other 4xx is sent once; the attempts are bounded.

The peer is a test double: a tiny Starlette app served by uvicorn on a free port that answers
a scripted sequence of statuses and records when each request arrived. Our client code runs
unchanged against it (the predicate itself is unit-tested in tests/unit/services/test_retry_predicate.py).
"""

from __future__ import annotations

import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from host.processes import free_port
from services.clients import ServiceClient
from tests.servers import uvicorn_server


class ScriptedPeer:
    """Answers ``POST /v1/x`` with the next (status, headers) of its script, then 200; records arrivals."""

    def __init__(self, script: list[tuple[int, dict]]) -> None:
        self.script = list(script)
        self.arrivals: list[float] = []
        self.auth: list[str | None] = []
        self.app = Starlette(routes=[Route("/v1/x", self.answer, methods=["POST"])])

    async def answer(self, request: Request) -> JSONResponse:
        self.arrivals.append(time.monotonic())
        self.auth.append(request.headers.get("authorization"))
        if self.script:
            status, headers = self.script.pop(0)
            return JSONResponse({"detail": f"scripted {status}"}, status_code=status, headers=headers)
        return JSONResponse({"ok": True})

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def _call(peer: ScriptedPeer, **client_kw) -> httpx.Response:
    port = free_port()
    async with uvicorn_server(peer.app, port):
        async with ServiceClient(f"http://127.0.0.1:{port}", "peer-token", timeout_s=10, **client_kw) as client:
            return await client.request("POST", "/v1/x", {"a": 1})


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_429_and_5xx_are_retried_after_the_servers_retry_after(status):
    peer = ScriptedPeer([(status, {"Retry-After": "1"}), (status, {"Retry-After": "1"})])
    resp = await _call(peer)
    assert resp.status_code == 200 and resp.json() == {"ok": True}
    assert len(peer.arrivals) == 3
    # the client's own back-off waits 0.2-0.4 s, then 0.4-0.6 s: each wait here is the server's 1 s
    assert all(gap >= 0.95 for gap in peer.gaps()), peer.gaps()
    assert peer.auth == ["Bearer peer-token"] * 3


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 422])
async def test_other_4xx_are_sent_once(status):
    peer = ScriptedPeer([(status, {"Retry-After": "1"})])
    with pytest.raises(httpx.HTTPStatusError) as failed:
        await _call(peer)
    assert failed.value.response.status_code == status
    assert len(peer.arrivals) == 1


async def test_attempts_are_bounded():
    peer = ScriptedPeer([(502, {})] * 10)
    with pytest.raises(httpx.HTTPStatusError) as failed:
        await _call(peer, attempts=3)
    assert failed.value.response.status_code == 502
    assert len(peer.arrivals) == 3
