"""The FastAPI app factory every tandem service is built with.

``create_app`` gives each service the same edge:

- the security edge of :mod:`services.security`: bearer-token auth with scopes and the control
  plane's browser session (:class:`~services.security.Auth`), the guard against web pages in the
  operator's browser (:class:`~services.security.BrowserGuard`) and the request-size cap
  (:class:`~services.security.BodyLimit`);
- ``/healthz`` (200 while the service's ``health`` check passes, else 503)
  and ``/metrics`` (Prometheus text from the app's own registry);
- one error mapping: :class:`ServiceError` carries its HTTP status (and
  ``Retry-After`` for 429/503); request validation errors are 422 and name
  the field (``detail[i].loc``).

Running the app (uvicorn, a port that cannot be had) is :mod:`services.serving`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.security import LOOPBACK_HOSTS, SESSION_COOKIE, Auth, BodyLimit, BrowserGuard, SignIn

if TYPE_CHECKING:
    from services.settings import CommonSettings


class ServiceError(Exception):
    """A domain error with the HTTP status it maps to.

    ``errors`` (optional) is a list of structured problems returned beside
    the message, e.g. one entry per bad line of an upload.
    """

    def __init__(
        self, status: int, message: str, *, retry_after: float | None = None, errors: list | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.errors = errors


def _json(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


def create_app(
    title: str,
    settings: CommonSettings,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None,
    health: Callable[[], Awaitable[bool]] | None = None,
    registry: CollectorRegistry | None = None,
    body_limits: dict[str, int] | None = None,
    cookie_login_path: str | None = None,
    session_max_age_s: int = 12 * 3600,
) -> FastAPI:
    """A FastAPI app with tandem's edge. Services add their routers to it.

    ``body_limits`` sets per-path request-size caps (default
    ``settings.max_body_bytes``); ``cookie_login_path`` enables the browser
    session cookie on that path, valid ``session_max_age_s`` (see
    :class:`Auth`). Auth is off when the settings hold no token
    (``check_auth_safe`` allows that on loopback only); a token shorter
    than ``MIN_TOKEN_CHARS`` is refused there too (``check_tokens``).
    """
    settings.check_auth_safe()
    token = settings.token.get_secret_value() if settings.token else None
    auth = Auth(token, settings.scoped_tokens(), cookie_login_path, session_max_age_s)
    # FastAPI's own /openapi.json and /docs are plain routes that no dependency guards:
    # they are turned off here and served below as routes behind ``auth``.
    app = FastAPI(
        title=title,
        lifespan=lifespan,
        dependencies=[Depends(auth)] if auth.bearers else [],
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = registry or CollectorRegistry()
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes, body_limits=body_limits)
    allowed = settings.allowed_hosts
    if allowed is None and not auth.bearers:
        # the bind address too (127.0.0.2 is loopback as well; check_auth_safe allowed it)
        bound = f"[{settings.host}]" if ":" in settings.host else settings.host
        allowed = [*LOOPBACK_HOSTS, bound.lower()]
    # added last: runs first, before the body limit and auth
    app.add_middleware(
        BrowserGuard, allowed_hosts=None if allowed is None else tuple(allowed), check_writes=not auth.bearers
    )

    @app.exception_handler(SignIn)
    async def _signed_in(request: Request, e: SignIn) -> RedirectResponse:
        resp = RedirectResponse(e.location, status_code=303)
        resp.set_cookie(
            SESSION_COOKIE, e.cookie, max_age=e.max_age_s, path="/", httponly=True, samesite="Strict",
            secure=request.url.scheme == "https",
        )
        return resp

    @app.exception_handler(ServiceError)
    async def _service_error(_req: Request, e: ServiceError) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after is not None else None
        body = {"detail": e.message} if e.errors is None else {"detail": e.message, "errors": e.errors}
        return _json(e.status, body, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, e: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in e.errors()
        ]
        fields = "; ".join(f"{'.'.join(str(p) for p in x['loc'][1:]) or 'body'}: {x['msg']}" for x in errors)
        return _json(422, {"detail": errors, "message": fields})

    @app.get("/healthz", include_in_schema=False)
    async def _healthz() -> JSONResponse:
        ok = True if health is None else await health()
        return _json(200 if ok else 503, {"status": "ok" if ok else "unhealthy", "service": title})

    @app.get("/openapi.json", include_in_schema=False)
    async def _openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def _docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def _redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{title} - ReDoc")

    @app.get("/metrics", include_in_schema=False)
    async def _metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(app.state.metrics), media_type=CONTENT_TYPE_LATEST)

    return app
