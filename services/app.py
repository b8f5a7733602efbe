"""The FastAPI app factory every tandem service is built with.

``create_app`` gives each service the same edge:

- bearer-token auth on every route except ``/healthz`` (constant-time
  comparison; 401 with ``WWW-Authenticate`` when missing or wrong; scoped
  extra tokens from ``settings.tokens``, 403 when the scope is missing; an
  optional read-only browser session cookie);
- a request-size cap (413) checked before the body is read into memory;
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
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.settings import ServiceSettings

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


class EdgeMiddleware:
    """Auth and body-size checks, as plain ASGI so nothing is read before they pass.

    Credentials: ``Authorization: Bearer <token>`` with ``token`` (every
    scope) or one of ``tokens`` (its scopes); a route needs ``read`` for
    GET/HEAD/OPTIONS and ``write`` otherwise (403 without it). With
    ``cookie_login_path``, ``GET <path>?token=T`` sets an HttpOnly session
    cookie and redirects to the same URL without the token; the cookie
    authorizes safe methods only (a browser viewing a dashboard; forged
    cross-site POSTs get nothing from it). ``body_limits`` overrides
    ``max_body_bytes`` per path.
    """

    def __init__(
        self,
        app,
        token: str | None,
        max_body_bytes: int,
        *,
        tokens: dict[str, list[str]] | None = None,
        body_limits: dict[str, int] | None = None,
        cookie_login_path: str | None = None,
    ) -> None:
        self.app = app
        self.bearers: list[tuple[bytes, frozenset[str]]] = []
        if token:
            self.bearers.append((token.encode(), SCOPES))
        for extra, scopes in (tokens or {}).items():
            self.bearers.append((extra.encode(), frozenset(scopes) & SCOPES))
        self.cookies = [
            (session_cookie_value(t.decode()).encode(), scopes & {"read"}) for t, scopes in self.bearers
        ]
        self.max_body_bytes = max_body_bytes
        self.body_limits = body_limits or {}
        self.cookie_login_path = cookie_login_path

    def _authorize(self, scope, headers: dict[bytes, bytes]):
        """None when the request may pass, else the response to send."""
        method = scope["method"]
        if self.cookie_login_path == scope["path"] and method == "GET":
            query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            login = [v for k, v in query if k == "token"]
            if login:
                scopes = _match(login[-1].encode(), self.bearers)
                if scopes is None:
                    return _json(401, {"detail": "invalid token"}, {"WWW-Authenticate": "Bearer"})
                if "read" not in scopes:
                    return _json(403, {"detail": "this token lacks the 'read' scope"})
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                secure = "; Secure" if scope.get("scheme") == "https" else ""
                cookie = f"{SESSION_COOKIE}={session_cookie_value(login[-1])}; HttpOnly; SameSite=Strict; Path=/{secure}"
                location = scope["path"] + (f"?{rest}" if rest else "")
                return RedirectResponse(location, status_code=303, headers={"Set-Cookie": cookie})
        auth = headers.get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        cookie = _cookie(headers.get(b"cookie", b""), SESSION_COOKIE) if method in SAFE_METHODS else b""
        if given:
            scopes = _match(given, self.bearers)
            problem = "invalid bearer token"
        elif cookie:
            scopes = _match(cookie, self.cookies)
            problem = "invalid session cookie"
        else:
            scopes, problem = None, "missing bearer token"
        if scopes is None:
            return _json(401, {"detail": problem}, {"WWW-Authenticate": "Bearer"})
        need = required_scope(method)
        if need not in scopes:
            return _json(403, {"detail": f"this token lacks the '{need}' scope"})
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.bearers and scope["path"] not in PUBLIC_PATHS:
            refusal = self._authorize(scope, headers)
            if refusal is not None:
                return await refusal(scope, receive, send)
        limit = self.body_limits.get(scope["path"], self.max_body_bytes)
        length = headers.get(b"content-length")
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


def _cookie(header: bytes, name: str) -> bytes:
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name.encode():
            return value
    return b""


def create_app(
    title: str,
    settings: ServiceSettings,
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
    session cookie on that path (see :class:`EdgeMiddleware`).
    """
    settings.check_auth_safe()
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = registry or CollectorRegistry()
    token = settings.token.get_secret_value() if settings.token else None
    app.add_middleware(
        EdgeMiddleware,
        token=token,
        max_body_bytes=settings.max_body_bytes,
        tokens=settings.tokens,
        body_limits=body_limits,
        cookie_login_path=cookie_login_path,
    )

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

    @app.get("/metrics", include_in_schema=False)
    async def _metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(app.state.metrics), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(app: FastAPI, settings: ServiceSettings) -> None:
    """Run ``app`` with uvicorn on the settings' host and port (blocks)."""
    import uvicorn

    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)

