"""The learner's HTTP routes behind its bearer token: every route but ``/healthz`` refuses a
request without a token or with a wrong one (401) and answers the right one. All its routes are
GETs, so a read-only token of TANDEM_TOKENS opens them too (a write would need the write scope, 403).

A real ``tandem serve learner`` process in stack mode (no TANDEM_RUN_ID) with a Redis of its
own that holds no run: it serves HTTP while it waits for a run, so no model or DeepSpeed engine
is started. The routes checked are compared with the app's own list, so a route added later fails
the test until it is checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from broker.embedded import EmbeddedRedis
from deploy.stack import wait_healthy
from host.processes import free_port, stop_group

TOKEN = "learner-auth-token-" + "x" * 16
READ_TOKEN = "learner-read-token-" + "y" * 16
REPO = Path(__file__).resolve().parents[3]

# the learner service imports torch and DeepSpeed as it starts (about 8 s of CPU, 26 s for the file in make
# test-fast on two workers): make test runs it (docs/testing.md)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learner-auth")
    redis = EmbeddedRedis(tmp / "redis").start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_RUN_ID", "TANDEM_TOKEN", "TANDEM_TOKENS")}
    env.update(REDIS_URL=redis.url, TANDEM_TOKEN=TOKEN, TANDEM_TOKENS=json.dumps({READ_TOKEN: ["read"]}),
               TANDEM_PORT=str(port), TANDEM_RUN_DIR=str(tmp / "runs"), DS_ACCELERATOR="cpu",
               TANDEM_LOG_LEVEL="warning")
    log = tmp / "learner.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "learner"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120, log)
        yield url
    finally:
        stop_group(proc)
        redis.stop()


ROUTES = sorted([("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/v1/status"),
                 ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")])


def test_the_routes_checked_are_all_the_learners():
    """The learner app's own route list (built here, not at collection: it imports torch)."""
    from learner.service import build_app
    from learner.settings import LearnerSettings

    app = build_app(LearnerSettings(token=TOKEN, redis_url="redis://127.0.0.1:1/0"), None)
    assert sorted((m, r.path) for r in app.routes for m in r.methods - {"HEAD"}) == ROUTES


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_but_healthz_needs_the_token(learner, method, path):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, learner + path, headers=headers, timeout=30)

    if path == "/healthz":
        assert call({}).status_code == 200
        return
    for headers in ({}, {"Authorization": f"Bearer {TOKEN[:-1]}z"}, {"Authorization": f"Basic {TOKEN}"}):
        refused = call(headers)
        assert refused.status_code == 401, (headers, refused.text)
        assert refused.headers["www-authenticate"] == "Bearer"
    assert call({"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    read = call({"Authorization": f"Bearer {READ_TOKEN}"})
    assert read.status_code == (200 if method == "GET" else 403), read.text


def test_the_status_route_answers_the_token_with_the_learners_state(learner):
    status = httpx.get(learner + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert status.json()["state"] == "idle"
