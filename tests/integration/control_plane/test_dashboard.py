"""The dashboard in a real browser: headless Chromium loads the page of a real run.

A real control plane (uvicorn on a free port, real Redis) holds a run whose
metrics were appended through ``MetricsLog``, as the learner, rollout
servers and evaluator do. Chromium signs in with ``/?token=`` (session
cookie), runs the page's scripts — the vendored uPlot and the dashboard's
own — and the DOM it dumps must hold one uPlot chart (canvas and legend,
both built by the library) per layout entry, whose draw hook saw exactly the
points written and whose legend shows the API's latest values. Chromium's
console must stay empty: a script or style the CSP refuses, or an uncaught
error, would log there.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import shutil
import signal
from html.parser import HTMLParser

import httpx
import pytest
from starlette.responses import PlainTextResponse

from broker import Keys
from control_plane.dashboard import CSP, STATIC
from services import timeline
from services.evaluate import EvalLog, EvalResult
from services.runs import CHARTS, METRICS, CompletionsLog, MetricsLog, RunStore
from tests.fixtures.control import ARITH_LINES, READ_TOKEN, TOKEN, run_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING_CHROMIUM = ("no chromium on PATH: the browser tests need Debian's chromium package. Install it with "
                    "`sudo apt-get install -y chromium` (`make test` installs it when run as root).")


def require_chromium() -> str:
    """The Chromium binary; a missing browser fails the test (a skip would hide that it never ran)."""
    if CHROMIUM is None:
        pytest.fail(MISSING_CHROMIUM)
    return CHROMIUM

STEPS = 6
LIBRARY = "/static/uPlot.iife.min.js"


class Charts(HTMLParser):
    """Per ``<figure data-chart>``: what uPlot drew (``data-drawn``), its canvases, its legend rows."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict] = {}
        self.current: str | None = None
        self.depth = 0
        self.cell: str | None = None  # "label" or "value" while inside a legend cell
        self.text: list[str] = []
        self.error: list[str] = []
        self.in_error = False
        self.scales: dict[str, dict] = {}  # chart id -> series label -> [scale, min, max]
        self.breakdown: dict | None = None
        self.side: str | None = None
        self.bars: dict[str, int] = {}
        self.segments: dict[str, dict[str, int]] = {}
        self.completions: dict | None = None  # data-rows, the header, each row's cells, the elements inside
        self.in_completions = False
        self.completions_cell = False
        self.no_completions_shown: bool | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "table" and a.get("id") == "completions":
            self.in_completions = True
            self.completions = {"rows": int(a["data-rows"]), "header": [], "cells": [], "tags": set()}
        elif self.in_completions:
            self.completions["tags"].add(tag)
            if tag == "th":
                self.completions["header"].append("")
            elif tag == "tr" and "data-id" in a:
                self.completions["cells"].append([])
            elif tag == "td":
                self.completions["cells"][-1].append("")
            self.completions_cell = self.completions_cell or tag in ("th", "td")
        if a.get("id") == "no-completions":
            self.no_completions_shown = "hidden" not in a
        if tag == "figure" and "data-chart" in a:
            self.current, self.depth = a["data-chart"], 0
            drawn = json.loads(a["data-drawn"]) if "data-drawn" in a else None
            self.charts[self.current] = {"drawn": drawn, "canvases": 0, "legend": []}
        elif self.current:
            chart = self.charts[self.current]
            if tag == "figure":
                self.depth += 1
            elif tag == "canvas":
                chart["canvases"] += 1
            elif tag == "tr" and "u-series" in classes:
                chart["legend"].append(["", ""])
            elif "u-label" in classes:
                self.cell = "label"
            elif "u-value" in classes:
                self.cell = "value"
        if a.get("id") == "error":
            self.in_error = "hidden" not in a
        if tag == "figure" and "data-scales" in a:
            self.scales[a["data-chart"]] = json.loads(a["data-scales"])
        if a.get("id") == "chart-breakdown" and "data-breakdown" in a:
            self.breakdown = json.loads(a["data-breakdown"])
        if tag == "div" and "data-side" in a:
            self.side = a["data-side"]
        if tag == "div" and "bar" in classes and "data-step" in a:
            self.bars[self.side] = self.bars.get(self.side, 0) + 1
        if tag == "div" and "seg" in classes:  # the segments drawn, by activity (their tooltip names it)
            activity = a["title"].split(" · ")[1].rsplit(" ", 2)[0]
            self.segments.setdefault(self.side, {}).setdefault(activity, 0)
            self.segments[self.side][activity] += 1

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_completions = False
        if tag in ("th", "td"):
            self.completions_cell = False
        if tag in ("div", "td"):
            self.cell = None
        if tag == "p":
            self.in_error = False
        if tag == "figure" and self.current:
            if self.depth == 0:
                self.current = None
            else:
                self.depth -= 1

    def handle_data(self, data):
        self.text.append(data)
        if self.in_error:
            self.error.append(data)
        if self.in_completions and self.completions_cell:
            target = self.completions["cells"][-1] if self.completions["cells"] else self.completions["header"]
            target[-1] += data
        if self.cell and self.current and self.charts[self.current]["legend"]:
            self.charts[self.current]["legend"][-1][0 if self.cell == "label" else 1] += data


async def _chromium(url: str, profile) -> tuple[str, list[str]]:
    """Chromium's DOM of ``url`` after its scripts ran, and its console lines.

    The browser is ours to end (process group).
    """
    proc = await asyncio.create_subprocess_exec(
        require_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        "--window-size=1280,1400", "--enable-logging=stderr", "--v=0",
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
    log = err.decode(errors="replace")
    assert proc.returncode == 0, log[-2000:]
    return out.decode(), [line for line in log.splitlines() if ":CONSOLE" in line]


def _latest(points: list[dict], name: str, source: str | None = None) -> float:
    return [p["values"][name] for p in points if name in p["values"] and source in (None, p["source"])][-1]


def _shows(text: str, value: float) -> bool:
    """The legend's rendering of ``value`` (3 significant digits at least)."""
    return math.isclose(float(text), value, rel_tol=5e-3)


@pytest.mark.browser
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
            evals = EvalLog(control_redis, Keys(run_id))  # the rollout servers' held-out points (step = version)
            await evals.record(0, EvalResult(0.3, 0.3, 200, frozenset({0}), 0), "rollout:r0")
            for step in range(1, STEPS + 1):
                await log.append(
                    "learner", step, reward_mean=0.1 * step, loss=1 / step, kl=0.01 * step, entropy=2.0,
                    lag_max=1, lag_mean=0.5, stale_dropped=40 * step, learner_tokens_per_s=800 + step,
                    learner_idle_frac=0.2,
                )
                await log.append("rollout:r0", step, rollout_tokens_per_s=4000 + step, rollout_idle_frac=0.1)
                if step <= 3:  # a second rollout server, for half the run: a series of its own
                    await log.append("rollout:r1", step, rollout_tokens_per_s=3000 + step)
            # the last with 4 samples per prompt: mean@4 and pass@k
            await evals.record(STEPS, EvalResult(0.8, 0.8, 200, frozenset({STEPS}), 0, samples=4,
                                                 pass_at={1: 0.8, 2: 0.875, 4: 0.95}), "rollout:r0")
            await store.update(run_id, step=STEPS, policy_version=STEPS)
            spans = _timeline_of_steps(STEPS)
            await timeline.append(control_redis, Keys(run_id), spans)
            expected = (await client.get(f"/v1/runs/{run_id}/breakdown")).json()
            assert [s["step"] for s in expected["steps"]] == list(range(1, STEPS + 1))
            assert expected["steps"] == timeline.breakdown(spans)
            points = (await client.get(f"/v1/runs/{run_id}/metrics")).json()["points"]
            page = await client.get("/")
            assert page.headers["content-security-policy"] == CSP
            assert "unsafe" not in CSP and "script-src 'self'" in CSP and "style-src 'self'" in CSP
            lib = await client.get(LIBRARY)
            assert lib.status_code == 200 and lib.headers["content-type"].startswith("text/javascript")

        dom, console = await _chromium(f"{url}/?token={READ_TOKEN}&run={run_id}", tmp_path / "chromium")

    page = Charts()
    page.feed(dom)
    text = " ".join(page.text)
    assert console == [], console
    assert 'data-ready="1"' in dom, dom[-3000:]
    assert run_id in text and "running" in text
    assert page.completions["rows"] == 0 and page.no_completions_shown and "no completions yet" in text
    # the newest held-out result and the version it measured
    assert f"mean@4 0.800, pass@1 0.800, pass@2 0.875, pass@4 0.950 (version {STEPS})" in text
    assert set(page.charts) == set(CHARTS)
    for chart_id, (_title, names) in CHARTS.items():
        chart = page.charts[chart_id]
        assert chart["canvases"] == 1, (chart_id, chart)
        labels = [label for label, _value in chart["legend"]]
        # one series per metric, in layout order ("name · source" where two sources report it)
        assert labels[0] == "step" and list(dict.fromkeys(x.split(" · ")[0] for x in labels[1:])) == names, labels
        assert list(chart["drawn"]) == labels[1:], (chart_id, chart)
        for label, value in chart["legend"][1:]:
            name, _, source = label.partition(" · ")
            assert _shows(value, _latest(points, name, source or None)), (chart_id, label, value)
    drawn = {cid: page.charts[cid]["drawn"] for cid in CHARTS}
    assert drawn["reward"] == {"reward_mean": STEPS, "accuracy": 2, "pass_at_n": 1, "held_out_reward": 2}
    assert drawn["staleness"] == {"lag_max": STEPS, "lag_mean": STEPS, "stale_dropped": STEPS}
    assert drawn["throughput"] == {
        "rollout_tokens_per_s · rollout:r0": STEPS, "rollout_tokens_per_s · rollout:r1": 3, "learner_tokens_per_s": STEPS
    }
    assert drawn["idle"] == {"rollout_idle_frac": STEPS, "learner_idle_frac": STEPS}
    assert drawn["loss"] == {"loss": STEPS, "kl": STEPS, "entropy": STEPS}
    assert page.charts["reward"]["legend"][0] == ["step", str(STEPS)]
    # the lag (0..eta) and the cumulative stale drops (tens to hundreds) on scales of their own
    scales = page.scales["staleness"]
    assert scales["lag_max"][0] == scales["lag_mean"][0] == "y" and scales["stale_dropped"][0] == "stale_dropped"
    assert scales["lag_max"][2] < 2 and scales["stale_dropped"][2] >= 40 * STEPS, scales
    # the per-step breakdown: every step stacked, the seconds the API computed from the spans
    shown = page.breakdown
    assert shown["steps"] == list(range(1, STEPS + 1))
    for side in ("learner", "rollout"):
        for activity, secs in shown[side].items():
            assert math.isclose(secs, sum(s[side][activity] for s in expected["steps"]), abs_tol=1e-6), (side, activity)
    assert math.isclose(shown["learner"]["read"], STEPS * 0.5, abs_tol=1e-3)
    assert math.isclose(shown["rollout"]["full"], STEPS * 0.3, abs_tol=1e-3)
    assert page.bars == {"learner": STEPS, "rollout": STEPS}
    assert page.segments == {"learner": dict.fromkeys(["forward", "backward", "optimizer", "step_other", "read"], STEPS),
                             "rollout": dict.fromkeys(["generate", "full"], STEPS)}, page.segments
    assert "read (idle)" in text and "generate" in text


def _timeline_of_steps(n: int) -> list[timeline.Span]:
    """Spans of ``n`` 2-second steps: the learner reads 0.5 s, steps 1.5 s (forward 0.5, backward 0.7,
    optimizer 0.1); the rollout server waits 0.3 s on a full admission, then generates 1.7 s."""
    spans, t = [], 1_700_000_000.0
    for step in range(1, n + 1):
        spans += [
            timeline.Span("read", "learner", "rank0", t, t + 0.5, {"step": step}),
            timeline.Span("step", "learner", "rank0", t + 0.5, t + 2.0, {"step": step}),
            timeline.Span("forward", "learner", "rank0", t + 0.5, t + 1.0, {"micro_batch": 0}),
            timeline.Span("backward", "learner", "rank0", t + 1.0, t + 1.7, {"micro_batch": 0}),
            timeline.Span("optimizer", "learner", "rank0", t + 1.7, t + 1.8, {}),
            timeline.Span("admit", "rollout:r0", "admit", t, t + 0.3, {"reason": "full"}),
            timeline.Span("generate", "rollout:r0", "groups", t + 0.3, t + 2.0, {"group": f"g{step}"}),
        ]
        t += 2.0
    return spans


ATTACK = "<img src=x onerror=alert(1)>"


@pytest.mark.browser
async def test_dashboard_lists_the_newest_completions_as_text(serve_control, control_redis, tmp_path):
    """The newest 20 rows, newest first, with the union of the logged columns; a completion that is markup
    shows as its text and creates no element."""
    async with serve_control() as url:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            set_id = (await client.post("/v1/prompt-sets", content=json.dumps(ARITH_LINES[0]))).json()["id"]
            r = await client.post("/v1/runs", json={"prompt_set_id": set_id, "config": run_config()})
            run_id = r.json()["run_id"]
        rows = [
            {"step": step, "version": step - 1, "group_id": f"g{step}", "prompt": f"What is {step} + {i}?",
             "completion": f"{step + i}", "reward": 1.0, "advantage": 0.25 * i,
             "logged": {"format_ok": True} if i % 2 else {}}
            for step in range(1, STEPS + 1) for i in range(4)
        ]
        rows[-1] |= {"completion": ATTACK, "reward": -0.5, "logged": {"overlong_penalty": -0.5}}
        await CompletionsLog(control_redis, Keys(run_id)).append(rows)
        dom, console = await _chromium(f"{url}/?token={READ_TOKEN}&run={run_id}", tmp_path / "chromium")

    page = Charts()
    page.feed(dom)
    assert console == [], console
    table = page.completions
    assert table["rows"] == len(table["cells"]) == 20, table
    assert table["header"] == ["step", "prompt", "completion", "reward", "advantage", "format_ok", "overlong_penalty"]
    newest = table["cells"][0]
    assert newest == [str(STEPS), f"What is {STEPS} + 3?", ATTACK, "-0.500", "0.750", "–", "-0.500"], newest
    assert table["cells"][2][5:] == ["true", "–"] and table["cells"][-1][0] == "2", table["cells"]
    assert "img" not in table["tags"] and "<img" not in dom.split('id="completions"')[1].split("</table>")[0]
    assert page.no_completions_shown is False


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


@pytest.mark.browser
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
        dom, console = await _chromium(f"{url}/?token={READ_TOKEN}&run={run_id}", tmp_path / "chromium")

    page = Charts()
    page.feed(dom)
    assert console == [], console
    assert hook.polls >= 2, "the page never polled again"
    reward = page.charts["reward"]
    assert reward["drawn"] == {"reward_mean": 2 * STEPS, "accuracy": 0, "pass_at_n": 0, "held_out_reward": 0}
    assert reward["canvases"] == 1  # the chart was updated in place, not drawn twice
    assert reward["legend"][1][0] == "reward_mean" and _shows(reward["legend"][1][1], 0.05 * 2 * STEPS)
    assert str(2 * STEPS) in " ".join(page.text)  # the status moved on too


class WithoutLibrary:
    """ASGI hook: the chart library's file answers 404, as if it were missing from the package."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == LIBRARY:
            return await PlainTextResponse("gone", status_code=404)(scope, receive, send)
        return await self.app(scope, receive, send)


@pytest.mark.browser
async def test_without_the_chart_library_the_page_says_so_and_draws_nothing(serve_control, control_redis, tmp_path):
    async with serve_control(wrap=WithoutLibrary) as url:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            set_id = (await client.post("/v1/prompt-sets", content=json.dumps(ARITH_LINES[0]))).json()["id"]
            r = await client.post("/v1/runs", json={"prompt_set_id": set_id, "config": run_config()})
            run_id = r.json()["run_id"]
        await MetricsLog(control_redis, Keys(run_id)).append("learner", 1, reward_mean=0.5)
        dom, console = await _chromium(f"{url}/?token={READ_TOKEN}&run={run_id}", tmp_path / "chromium")

    page = Charts()
    page.feed(dom)
    assert 'data-ready="1"' not in dom
    assert all(c["canvases"] == 0 and c["drawn"] is None for c in page.charts.values()), page.charts
    assert "uPlot.iife.min.js did not load" in " ".join(page.error), page.error


async def test_dashboard_without_credentials_is_refused(serve_control):
    async with serve_control() as url:
        async with httpx.AsyncClient(base_url=url) as client:
            for path in ("/", "/static/dashboard.js", LIBRARY, "/static/uPlot.min.css"):
                assert (await client.get(path)).status_code == 401, path


def test_vendored_library_is_the_release_its_note_names():
    """``static/uPlot.LICENSE`` records the version and hashes; the files must still match them."""
    note = (STATIC / "uPlot.LICENSE").read_text()
    version = re.search(r"uPlot (\d+\.\d+\.\d+)", note).group(1)
    assert f"(v{version})" in (STATIC / "uPlot.iife.min.js").read_text()[:200]
    assert "MIT License" in note
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((STATIC / name).read_bytes()).hexdigest()
        assert re.search(rf"{re.escape(name)} +sha256 {digest}", note), name


def test_every_charted_metric_is_documented():
    assert all(name in METRICS for _title, names in CHARTS.values() for name in names)
