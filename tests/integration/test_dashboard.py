"""The dashboard in a real browser: headless Chromium loads the page of a real run.

A real control plane (uvicorn on a free port, real Redis) holds a run whose
metrics were appended through ``MetricsLog``, as the learner, rollout
servers and evaluator do. Chromium signs in with ``/?token=`` (session
cookie), runs the page's script, and the DOM it dumps must hold one chart
per layout entry with exactly the data points written.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from html.parser import HTMLParser

import httpx
import pytest

from broker import Keys
from services.runs import CHARTS, METRICS, MetricsLog, RunStore
from tests.fixtures.control import ARITH_LINES, READ_TOKEN, TOKEN, run_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (apt-get install chromium)")

STEPS = 6


class Charts(HTMLParser):
    """Per ``<svg data-chart>``: its data-points attribute and the circles drawn inside, by series."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict] = {}
        self.current: str | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "data-chart" in a:
            self.current = a["data-chart"]
            self.charts[self.current] = {"points": int(a["data-points"]), "circles": {}}
        elif tag == "circle" and self.current and a.get("class") == "pt":
            circles = self.charts[self.current]["circles"]
            circles[a["data-series"]] = circles.get(a["data-series"], 0) + 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self.current = None

    def handle_data(self, data):
        self.text.append(data)


async def _dump_dom(url: str, profile) -> str:
    """Chromium's DOM of ``url`` after its scripts ran; the browser is ours to end (process group)."""
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env={**os.environ, "DBUS_SESSION_BUS_ADDRESS": "disabled:"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


async def test_dashboard_draws_the_charts_of_a_real_run(serve_control, control_redis, tmp_path):
    async with serve_control() as url:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:
            body = "\n".join(json.dumps(x) for x in ARITH_LINES)
            set_id = (await client.post("/v1/prompt-sets", content=body)).json()["id"]
            r = await client.post("/v1/runs", json={"prompt_set_id": set_id, "config": run_config()})
            assert r.status_code == 201, r.text
            run_id = r.json()["run_id"]

        store, log = RunStore(control_redis), MetricsLog(control_redis, Keys(run_id))
        await store.set_state(run_id, "running")
        await log.append("eval", 0, accuracy=0.3)
        for step in range(1, STEPS + 1):
            await log.append(
                "learner", step, reward_mean=0.1 * step, loss=1 / step, kl=0.01 * step, entropy=2.0,
                lag_max=1, lag_mean=0.5, stale_dropped=step // 3, learner_tokens_per_s=800 + step,
                learner_idle_frac=0.2,
            )
            await log.append("rollout:r0", step, rollout_tokens_per_s=4000 + step, rollout_idle_frac=0.1)
        await log.append("eval", STEPS, accuracy=0.8)
        await store.update(run_id, step=STEPS, policy_version=STEPS)

        dom = await _dump_dom(f"{url}/?token={READ_TOKEN}&run={run_id}", tmp_path / "chromium")

    page = Charts()
    page.feed(dom)
    text = " ".join(page.text)
    assert 'data-ready="1"' in dom, dom[-3000:]
    assert run_id in text and "running" in text
    assert set(page.charts) == set(CHARTS)
    for chart_id, (_title, names) in CHARTS.items():
        chart = page.charts[chart_id]
        assert chart["points"] == sum(chart["circles"].values()), chart_id
        assert set(chart["circles"]) == set(names), (chart_id, chart)
    reward = page.charts["reward"]["circles"]
    assert reward == {"reward_mean": STEPS, "accuracy": 2}
    assert page.charts["staleness"]["points"] == 3 * STEPS
    assert page.charts["throughput"]["circles"] == {"rollout_tokens_per_s": STEPS, "learner_tokens_per_s": STEPS}
    assert page.charts["idle"]["points"] == 2 * STEPS


class AppendAfterFirstPoll:
    """ASGI hook: just before the page's first metrics response leaves, the run moves on.

    The first response was computed before the append, so only the page's
    next poll (``since=`` the last id it saw) can bring the new points: the
    charts must grow while the page is open.
    """

    def __init__(self, app, on_first_poll) -> None:
        self.app, self.on_first_poll, self.polls = app, on_first_poll, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/metrics"):
            return await self.app(scope, receive, send)
        self.polls += 1
        first = self.polls == 1

        async def send_after_append(message):
            if first and message["type"] == "http.response.start":
                await self.on_first_poll()
            await send(message)

        return await self.app(scope, receive, send_after_append)


async def test_open_page_picks_up_new_points(serve_control, control_redis, tmp_path):
    run_id = None
    hook = None

    async def more_steps():
        log = MetricsLog(control_redis, Keys(run_id))
        for step in range(STEPS + 1, 2 * STEPS + 1):
            await log.append("learner", step, reward_mean=0.05 * step)
        await RunStore(control_redis).update(run_id, step=2 * STEPS, policy_version=2 * STEPS)

    def wrap(app):
        nonlocal hook
        hook = AppendAfterFirstPoll(app, more_steps)
        return hook

    async with serve_control(wrap=wrap) as url:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:
            set_id = (await client.post("/v1/prompt-sets", content=json.dumps(ARITH_LINES[0]))).json()["id"]
            r = await client.post("/v1/runs", json={"prompt_set_id": set_id, "config": run_config()})
            run_id = r.json()["run_id"]
        log = MetricsLog(control_redis, Keys(run_id))
        for step in range(1, STEPS + 1):
            await log.append("learner", step, reward_mean=0.05 * step)
        dom = await _dump_dom(f"{url}/?token={READ_TOKEN}&run={run_id}", tmp_path / "chromium")

    page = Charts()
    page.feed(dom)
    assert hook.polls >= 2, "the page never polled again"
    assert page.charts["reward"]["circles"] == {"reward_mean": 2 * STEPS}
    assert str(2 * STEPS) in " ".join(page.text)  # the status moved on too


async def test_dashboard_without_credentials_is_refused(serve_control):
    async with serve_control() as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/")).status_code == 401
            assert (await client.get("/static/dashboard.js")).status_code == 401


def test_every_charted_metric_is_documented():
    assert all(name in METRICS for _title, names in CHARTS.values() for name in names)
