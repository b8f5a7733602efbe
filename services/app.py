"""The FastAPI app factory every tandem service is built with.

``create_app`` gives each service the same edge:

- bearer-token auth on every route except ``/healthz``, as one FastAPI
  security dependency (:class:`Auth`, app-wide): ``HTTPBearer`` for the
  token, ``APIKeyCookie`` for an optional read-only browser session;
  constant-time comparison; 401 with ``WWW-Authenticate`` when missing or
  wrong; scoped extra tokens from ``settings.tokens``, 403 when the scope is
  missing. ``/openapi.json`` and ``/docs`` are served behind it too;
- a request-size cap (413) checked before the body is read into memory
  (:class:`BodyLimit`, plain ASGI);
- ``/healthz`` (200 while the service's ``health`` check passes, else 503)
  and ``/metrics`` (Prometheus text from the app's own registry);
- one error mapping: :class:`ServiceError` carries its HTTP status (and
  ``Retry-After`` for 429/503); request validation errors are 422 and name
  the field (``detail[i].loc``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Annotated, NoReturn
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from services.settings import CommonSettings

log = logging.getLogger("tandem")

PUBLIC_PATHS = frozenset({"/healthz"})


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


SCOPES = frozenset({"read", "write"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SESSION_COOKIE = "tandem_session"

bearer_scheme = HTTPBearer(auto_error=False, description="TANDEM_TOKEN (every scope) or a token of TANDEM_TOKENS")
session_scheme = APIKeyCookie(
    name=SESSION_COOKIE, auto_error=False, description="Browser session from `GET /?token=T`; GET/HEAD only"
)


def required_scope(method: str) -> str:
    """``read`` for safe methods, ``write`` for everything else."""
    return "read" if method in SAFE_METHODS else "write"


def session_cookie_value(token: str) -> str:
    """The browser-session cookie derived from a token (it is not the token, and not a bearer)."""
    return hmac.new(token.encode(), b"tandem-session-cookie-v1", hashlib.sha256).hexdigest()


def _match(given: bytes, table: list[tuple[bytes, frozenset[str]]]) -> frozenset[str] | None:
    """Scopes of the entry equal to ``given``; compares against every entry (constant time)."""
    found = None
    for secret, scopes in table:
        if hmac.compare_digest(given, secret):
            found = scopes
    return found


def _unauthorized(problem: str) -> HTTPException:
    return HTTPException(401, problem, headers={"WWW-Authenticate": "Bearer"})


class SignIn(Exception):
    """Raised by :class:`Auth` for a valid ``?token=`` login: answered with a redirect that sets the cookie."""

    def __init__(self, location: str, cookie: str) -> None:
        super().__init__(location)
        self.location = location
        self.cookie = cookie


class Auth:
    """The app-wide security dependency: who may call which route.

    Credentials: ``Authorization: Bearer <token>`` with ``token`` (every
    scope) or one of ``tokens`` (its scopes); a route needs ``read`` for
    GET/HEAD/OPTIONS and ``write`` otherwise (403 without it). With
    ``cookie_login_path``, ``GET <path>?token=T`` sets an HttpOnly session
    cookie and redirects to the same URL without the token; the cookie
    authorizes safe methods only (a browser viewing a dashboard; forged
    cross-site POSTs get nothing from it). Paths in :data:`PUBLIC_PATHS`
    are open.

    FastAPI solves dependencies after it has read a route's declared JSON
    body (within :class:`BodyLimit`'s cap), so an anonymous request whose
    JSON does not parse gets 422, not 401; a streamed upload (a route that
    reads ``request.stream()``) is authorized before a byte of it is read.
    """

    def __init__(
        self, token: str | None, tokens: dict[str, list[str]] | None = None, cookie_login_path: str | None = None
    ) -> None:
        self.bearers: list[tuple[bytes, frozenset[str]]] = []
        if token:
            self.bearers.append((token.encode(), SCOPES))
        for extra, scopes in (tokens or {}).items():
            self.bearers.append((extra.encode(), frozenset(scopes) & SCOPES))
        self.cookies = [
            (session_cookie_value(t.decode()).encode(), scopes & {"read"}) for t, scopes in self.bearers
        ]
        self.cookie_login_path = cookie_login_path

    def _sign_in(self, request: Request, token: str) -> NoReturn:
        """Answer ``GET <login path>?token=T``: a redirect that sets the cookie, or 401/403."""
        scopes = _match(token.encode(), self.bearers)
        if scopes is None:
            raise _unauthorized("invalid token")
        if "read" not in scopes:
            raise HTTPException(403, "this token lacks the 'read' scope")
        rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
        raise SignIn(request.scope["path"] + (f"?{rest}" if rest else ""), session_cookie_value(token))

    async def __call__(
        self,
        request: Request,
        bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
        session: Annotated[str | None, Depends(session_scheme)],
    ) -> None:
        method = request.method
        path = request.scope["path"]
        if not self.bearers or path in PUBLIC_PATHS:
            return
        if method == "GET" and path == self.cookie_login_path:
            login = request.query_params.getlist("token")
            if login:
                self._sign_in(request, login[-1])
        if session and method not in SAFE_METHODS:
            session = None  # a cookie never authorizes a write
        if bearer is not None:
            # Starlette decodes headers as latin-1: this gives back the bytes sent
            scopes = _match(bearer.credentials.encode("latin-1"), self.bearers)
            problem = "invalid bearer token"
        elif session:
            scopes = _match(session.encode("latin-1"), self.cookies)
            problem = "invalid session cookie"
        else:
            scopes, problem = None, "missing bearer token"
        if scopes is None:
            raise _unauthorized(problem)
        need = required_scope(method)
        if need not in scopes:
            raise HTTPException(403, f"this token lacks the '{need}' scope")


class BodyLimit:
    """The request-size cap, as plain ASGI so nothing is read past it.

    413 from ``Content-Length`` before any of the body is read, or as soon
    as a streamed body passes the limit. ``body_limits`` overrides
    ``max_body_bytes`` per path.
    """

    def __init__(self, app, max_body_bytes: int, body_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_limits = body_limits or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.body_limits.get(scope["path"], self.max_body_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            resp = _json(413, {"detail": f"request body over {limit} bytes"})
            return await resp(scope, receive, send)

        seen = 0
        too_big = False

        async def capped_receive():
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    too_big = True
                    raise ServiceError(413, f"request body over {limit} bytes")
            return message

        try:
            await self.app(scope, capped_receive, send)
        except ServiceError as e:
            if not too_big:
                raise
            await _json(e.status, {"detail": e.message})(scope, receive, send)


def create_app(
    title: str,
    settings: CommonSettings,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None,
    health: Callable[[], Awaitable[bool]] | None = None,
    registry: CollectorRegistry | None = None,
    body_limits: dict[str, int] | None = None,
    cookie_login_path: str | None = None,
) -> FastAPI:
    """A FastAPI app with tandem's edge. Services add their routers to it.

    ``body_limits`` sets per-path request-size caps (default
    ``settings.max_body_bytes``); ``cookie_login_path`` enables the browser
    session cookie on that path (see :class:`Auth`). Auth is off when the
    settings hold no token (``check_auth_safe`` allows that on loopback only).
    """
    settings.check_auth_safe()
    token = settings.token.get_secret_value() if settings.token else None
    auth = Auth(token, settings.tokens, cookie_login_path)
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

    @app.exception_handler(SignIn)
    async def _signed_in(request: Request, e: SignIn) -> RedirectResponse:
        resp = RedirectResponse(e.location, status_code=303)
        resp.set_cookie(
            SESSION_COOKIE, e.cookie, path="/", httponly=True, samesite="Strict", secure=request.url.scheme == "https"
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


def serve(app: FastAPI, settings: CommonSettings) -> None:
    """Run ``app`` with uvicorn on the settings' host and port (blocks)."""
    import uvicorn

    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)

