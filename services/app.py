"""The FastAPI app factory every tandem service is built with.

``create_app`` gives each service the same edge:

- bearer-token auth on every route except ``/healthz`` (constant-time
  comparison; 401 with ``WWW-Authenticate`` when missing or wrong);
- a request-size cap (413) checked before the body is read into memory;
- ``/healthz`` (200 while the service's ``health`` check passes, else 503)
  and ``/metrics`` (Prometheus text from the app's own registry);
- one error mapping: :class:`ServiceError` carries its HTTP status (and
  ``Retry-After`` for 429/503); request validation errors are 422 and name
  the field (``detail[i].loc``).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.settings import ServiceSettings

log = logging.getLogger("tandem")

PUBLIC_PATHS = frozenset({"/healthz"})


class ServiceError(Exception):
    """A domain error with the HTTP status it maps to."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def _json(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


class EdgeMiddleware:
    """Auth and body-size checks, as plain ASGI so nothing is read before they pass."""

    def __init__(self, app, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.token is not None and scope["path"] not in PUBLIC_PATHS:
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not given or not hmac.compare_digest(given, self.token):
                msg = "missing bearer token" if not given else "invalid bearer token"
                resp = _json(401, {"detail": msg}, {"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            resp = _json(413, {"detail": f"request body over {self.max_body_bytes} bytes"})
            return await resp(scope, receive, send)

        seen = 0
        too_big = False

        async def capped_receive():
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    too_big = True
                    raise ServiceError(413, f"request body over {self.max_body_bytes} bytes")
            return message

        try:
            await self.app(scope, capped_receive, send)
        except ServiceError as e:
            if not too_big:
                raise
            await _json(e.status, {"detail": e.message})(scope, receive, send)


def create_app(
    title: str,
    settings: ServiceSettings,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None,
    health: Callable[[], Awaitable[bool]] | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """A FastAPI app with tandem's edge. Services add their routers to it."""
    settings.check_auth_safe()
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = registry or CollectorRegistry()
    token = settings.token.get_secret_value() if settings.token else None
    app.add_middleware(EdgeMiddleware, token=token, max_body_bytes=settings.max_body_bytes)

    @app.exception_handler(ServiceError)
    async def _service_error(_req: Request, e: ServiceError) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after is not None else None
        return _json(e.status, {"detail": e.message}, headers)

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


def error_body(e: Exception) -> str:
    return json.dumps({"detail": str(e)})
