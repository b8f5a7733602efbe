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
newest is shown otherwise. The chart layout is ``services.runs.CHARTS``.
Each chart's ``<figure data-chart>`` carries ``data-drawn``, the points
uPlot drew per series (set in its draw hook; the headless-browser test
reads it).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from services.app import ServiceError
from services.runs import CHARTS

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
