"""The control plane's browser dashboard: ``GET /`` and its static files.

Who talks to whom: a browser loads ``/`` (``/?token=T`` once to get a
read-only session cookie, valid ``TANDEM_CONTROL_SESSION_MAX_AGE_S``, 12 h
by default, and accepted by the control plane only; see ``services.security``;
the page then signs in again), then the page's script
polls this control plane's own JSON routes — ``/v1/runs``, ``/v1/runs/{id}``
and ``/v1/runs/{id}/metrics?since=`` — and draws the charts with uPlot
(``static/uPlot.iife.min.js``, vendored, MIT, see ``static/uPlot.LICENSE``).
Every file comes from this origin, so the page's CSP allows scripts and
styles from ``'self'`` only; uPlot draws on a canvas and sets styles through
the CSSOM, which that CSP does not restrict. ``/?run=ID`` selects a run; the
newest is shown otherwise. The chart layout is ``services.runs.CHARTS``;
a cumulative count (``stale_dropped``) gets a scale of its own on the right,
so the lag beside it keeps its 0..eta range. Each chart's ``<figure
data-chart>`` carries ``data-drawn``, the points uPlot drew per series, and
``data-scales``, each series' scale and range (set in its draw hook; the
headless-browser test reads them). Below the charts, every fifth poll, the
page reads ``/v1/runs/{id}/breakdown`` (the last steps' seconds by activity,
``services.timeline.breakdown``) and stacks them per step, busy below and
idle above, for the learner and the rollout servers; its figure carries
``data-breakdown`` (the seconds per activity over the steps shown). On the same polls it reads
``/v1/runs/{id}/completions?newest=true&limit=20`` and lists the newest trained samples (step, prompt,
completion, reward, advantage, then each column reward functions logged), as text only, in ``<table
id="completions">``, which carries ``data-rows`` (the rows shown).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from broker.keys import Keys
from services import timeline
from services.app import ServiceError
from services.runs import CHARTS, RunStore

STATIC = Path(__file__).parent / "static"
FILES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
}
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def dashboard() -> FileResponse:
    return FileResponse(
        STATIC / "dashboard.html",
        media_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
    )


@router.get("/static/{name}")
async def static(name: str) -> FileResponse:
    if name not in FILES:
        raise ServiceError(404, f"no static file {name}")
    return FileResponse(STATIC / name, media_type=FILES[name], headers={"X-Content-Type-Options": "nosniff"})


@router.get("/v1/dashboard/charts")
async def charts() -> dict:
    """The chart layout the page draws (ids, titles, metric names)."""
    return {cid: {"title": title, "metrics": names} for cid, (title, names) in CHARTS.items()}


BREAKDOWN_SPANS = 20_000
"""The newest spans the breakdown reads (the example's 80 a step: some 250 steps)."""


@router.get("/v1/runs/{run_id}/breakdown")
async def step_breakdown(run_id: str, request: Request, steps: int = Query(60, ge=1, le=1000)) -> dict:
    """The last ``steps`` learner steps' seconds by activity (``services.timeline.breakdown``), from the
    run's newest spans; the page stacks them (busy by activity, idle by reason)."""
    redis = request.app.state.redis
    await RunStore(redis).get(run_id)
    rows = await redis.xrevrange(Keys(run_id).timeline, count=BREAKDOWN_SPANS)
    spans = [timeline.Span.from_fields(f) for _, f in reversed(rows)]
    per_step = timeline.breakdown(spans)
    if len(rows) == BREAKDOWN_SPANS and per_step:
        per_step = per_step[1:]  # the oldest step read may be cut
    return {
        "learner": {"activities": timeline.LEARNER_ACTIVITIES, "idle": sorted(timeline.LEARNER_IDLE)},
        "rollout": {"activities": timeline.ROLLOUT_ACTIVITIES, "idle": sorted(timeline.ROLLOUT_IDLE)},
        "steps": per_step[-steps:],
    }
