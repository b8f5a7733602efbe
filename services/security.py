"""The security edge of every tandem service: who may call, from where, with how big a body.

``services.app.create_app`` installs all three on every service:

- bearer-token auth on every route except ``/healthz``, as one FastAPI
  security dependency (:class:`Auth`, app-wide): ``HTTPBearer`` for the
  token, ``APIKeyCookie`` for a read-only browser session that only the
  app with a ``cookie_login_path`` (the control plane) issues and accepts,
  with an expiry; constant-time comparison; 401 with ``WWW-Authenticate``
  when missing or wrong; scoped extra tokens from ``settings.tokens`` (and
  ``settings.openai_token``, scope ``infer``), 403 when the route's scope is
  missing (:data:`SCOPES`, :data:`ROUTE_SCOPES`); the request's
  :class:`Principal` (who owns what it makes) for the routes.
  ``/openapi.json`` and ``/docs`` are served behind it too. Tokens shorter
  than ``MIN_TOKEN_CHARS`` stop the start-up;
- a guard against web pages in the operator's browser (:class:`BrowserGuard`,
  plain ASGI, before auth): a ``Host`` allow-list (always with auth off, so
  a DNS-rebound page gets 403; with auth on when ``allowed_hosts`` is set),
  and with auth off, a state-changing request must carry a non-simple
  ``Content-Type`` or the :data:`CLIENT_HEADER`, which a cross-site page
  cannot send without a CORS preflight (never granted here);
- a request-size cap (413) checked before the body is read into memory
  (:class:`BodyLimit`, plain ASGI).

Tandem's own clients (``services.clients``) send :data:`CLIENT_HEADER`; the
control plane's dashboard signs in with :func:`session_cookie_value`'s cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Annotated, NoReturn
from urllib.parse import urlencode

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer

PUBLIC_PATHS = frozenset({"/healthz"})
CLIENT_HEADER = "X-Tandem-Client"
"""Sent by tandem's own clients (``services.clients``): a custom header makes a browser preflight a
cross-site request, so with auth off it marks a state-changing request as not from a web page."""
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""The Host names a service with auth off answers by default (any port): see :class:`BrowserGuard`."""
SIMPLE_CONTENT_TYPES = frozenset({"", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
"""Content types a page may POST cross-site without a CORS preflight (Fetch standard, "CORS-safelisted
request-header"); "" is a request with no body."""


def _json(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


SCOPES = frozenset({"read", "submit", "infer", "admin"})
"""What a token may do. ``read``: every GET/HEAD/OPTIONS route. ``submit``: upload prompt sets and
start runs, and delete or stop those it made itself (the control plane's routes in
:data:`ROUTE_SCOPES`). ``infer``: the rollout server's inference routes (the OpenAI-compatible
endpoint's key, ``TANDEM_OPENAI_TOKEN``). ``admin``: everything, other tokens' prompt sets and runs
included, and every other state-changing route (loading weights, scoring, running code in the
sandbox): what ``TANDEM_TOKEN`` holds."""
LEGACY_SCOPES = {"write": frozenset({"submit", "infer"})}
"""Scope names of ``TANDEM_TOKENS`` from before :data:`SCOPES`, and what they now grant: ``write``
opened every state-changing route; it keeps what a user does with it, never another's runs."""
ROUTE_SCOPES: dict[str, frozenset[str]] = {
    # the control plane: what a submitter does (control_plane.app checks the owner of what is deleted or stopped)
    "POST /v1/prompt-sets": frozenset({"submit"}),
    "DELETE /v1/prompt-sets/{set_id}": frozenset({"submit"}),
    "POST /v1/runs": frozenset({"submit"}),
    "POST /v1/runs/{run_id}/stop": frozenset({"submit"}),
    # the rollout server's inference routes (rollout_server.api, rollout_server.openai_api)
    "POST /v1/generate": frozenset({"infer"}),
    "POST /v1/chat/completions": frozenset({"infer"}),
    "POST /v1/completions": frozenset({"infer"}),
    "POST /inference/v1/generate": frozenset({"infer"}),
    "GET /v1/models": frozenset({"read", "infer"}),
}
"""``METHOD /route/{param}`` -> the scopes that open it, beside ``admin``. Any other route needs
``read`` for GET/HEAD/OPTIONS and ``admin`` otherwise."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SESSION_COOKIE = "tandem_session"

bearer_scheme = HTTPBearer(auto_error=False, description="TANDEM_TOKEN (every scope) or a token of TANDEM_TOKENS")
session_scheme = APIKeyCookie(
    name=SESSION_COOKIE, auto_error=False, description="Browser session from `GET /?token=T`; GET/HEAD only"
)


def granted(scopes) -> frozenset[str]:
    """What a token configured with ``scopes`` may do: :data:`LEGACY_SCOPES` translated, and ``admin``
    holding every scope."""
    out = set()
    for scope in scopes:
        out |= LEGACY_SCOPES.get(scope, {scope})
    return SCOPES if "admin" in out else frozenset(out) & SCOPES


def opening_scopes(method: str, route: str) -> frozenset[str]:
    """The scopes that open ``method route`` (``route`` as declared, ``/v1/runs/{run_id}/stop``)."""
    opened = ROUTE_SCOPES.get(f"{method} {route}")
    if opened is None:
        opened = frozenset({"read"}) if method in SAFE_METHODS else frozenset()
    return opened | {"admin"}


def owner_id(token: str) -> str:
    """Who owns what a token makes, as stored beside it: a digest of the token, never the token."""
    return hashlib.sha256(f"tandem-owner|{token}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Principal:
    """Who made a request: ``owner`` (:func:`owner_id` of its bearer token; None with auth off or a
    session cookie) and the scopes it holds."""

    owner: str | None
    scopes: frozenset[str]

    def may_manage(self, owner: str | None) -> bool:
        """True for ``admin``, or for the token that made it (something made with auth off, or before
        owners were recorded, has no owner: ``admin`` only)."""
        return "admin" in self.scopes or (owner is not None and owner == self.owner)


OPERATOR = Principal(None, SCOPES)
"""The principal of every request to a service with auth off (loopback only): the operator."""


def principal_of(request: Request) -> Principal:
    """The request's :class:`Principal`, as :class:`Auth` found it (:data:`OPERATOR` with auth off)."""
    return getattr(request.state, "principal", OPERATOR)


def session_cookie_value(token: str, issued_at: int) -> str:
    """The browser-session cookie issued at ``issued_at`` (unix seconds) for a token: ``<issued_at>.<mac>``.

    The MAC is keyed by the token and covers the issue time, so the cookie is neither the token nor
    a bearer, and its age is checked by the server (not only by the browser's Max-Age)."""
    mac = hmac.new(token.encode(), f"tandem-session-cookie-v2|{issued_at}".encode(), hashlib.sha256).hexdigest()
    return f"{issued_at}.{mac}"


def _match(given: bytes, table: list[tuple[bytes, Principal]]) -> Principal | None:
    """The principal of the entry equal to ``given``; compares against every entry (constant time)."""
    found = None
    for secret, who in table:
        if hmac.compare_digest(given, secret):
            found = who
    return found


def _unauthorized(problem: str) -> HTTPException:
    return HTTPException(401, problem, headers={"WWW-Authenticate": "Bearer"})


class SignIn(Exception):
    """Raised by :class:`Auth` for a valid ``?token=`` login: answered with a redirect that sets the cookie."""

    def __init__(self, location: str, cookie: str, max_age_s: int) -> None:
        super().__init__(location)
        self.location = location
        self.cookie = cookie
        self.max_age_s = max_age_s


class Auth:
    """The app-wide security dependency: who may call which route.

    Credentials: ``Authorization: Bearer <token>`` with ``token`` (every
    scope) or one of ``tokens`` (its scopes, :func:`granted`); a route needs
    one of :func:`opening_scopes` (403 without it). The request's
    :class:`Principal` is left in ``request.state.principal``. With
    ``cookie_login_path``, ``GET <path>?token=T`` sets an HttpOnly,
    SameSite=Strict session cookie (Max-Age ``session_max_age_s``) and
    redirects to the same URL without the token; the cookie authorizes safe
    methods only (a browser viewing a dashboard; forged cross-site POSTs get
    nothing from it), until it is ``session_max_age_s`` old. Without
    ``cookie_login_path`` no cookie is accepted: browsers send a host's
    cookies to every port of it, so the control plane's cookie must not open
    the other services. Paths in :data:`PUBLIC_PATHS` are open.

    FastAPI solves dependencies after it has read a route's declared JSON
    body (within :class:`BodyLimit`'s cap), so an anonymous request whose
    JSON does not parse gets 422, not 401; a streamed upload (a route that
    reads ``request.stream()``) is authorized before a byte of it is read.
    """

    def __init__(
        self,
        token: str | None,
        tokens: dict[str, list[str]] | None = None,
        cookie_login_path: str | None = None,
        session_max_age_s: int = 12 * 3600,
    ) -> None:
        self.bearers: list[tuple[bytes, Principal]] = []
        if token:
            self.bearers.append((token.encode(), Principal(owner_id(token), SCOPES)))
        for extra, scopes in (tokens or {}).items():
            self.bearers.append((extra.encode(), Principal(owner_id(extra), granted(scopes))))
        self.cookie_login_path = cookie_login_path
        self.session_max_age_s = session_max_age_s

    def _cookie_principal(self, cookie: str) -> tuple[Principal | None, str]:
        """The principal of a session cookie (``read`` at most, no owner) and the problem when there is none."""
        issued, _, _mac = cookie.partition(".")
        if not issued.isdigit() or len(issued) > 12:
            return None, "invalid session cookie"
        age = time.time() - int(issued)
        if not -60 <= age <= self.session_max_age_s:  # a minute of clock skew
            return None, "session cookie expired: sign in again with ?token="
        table = [(session_cookie_value(t.decode(), int(issued)).encode(), Principal(None, who.scopes & {"read"}))
                 for t, who in self.bearers]
        return _match(cookie.encode("latin-1"), table), "invalid session cookie"

    def _sign_in(self, request: Request, token: str) -> NoReturn:
        """Answer ``GET <login path>?token=T``: a redirect that sets the cookie, or 401/403."""
        who = _match(token.encode(), self.bearers)
        if who is None:
            raise _unauthorized("invalid token")
        if "read" not in who.scopes:
            raise HTTPException(403, "this token lacks the 'read' scope")
        rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
        cookie = session_cookie_value(token, int(time.time()))
        raise SignIn(request.scope["path"] + (f"?{rest}" if rest else ""), cookie, self.session_max_age_s)

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
        if self.cookie_login_path is None or method not in SAFE_METHODS:
            session = None  # a cookie never authorizes a write, nor opens a service that issues none
        if bearer is not None:
            # Starlette decodes headers as latin-1: this gives back the bytes sent
            who = _match(bearer.credentials.encode("latin-1"), self.bearers)
            problem = "invalid bearer token"
        elif session:
            who, problem = self._cookie_principal(session)
        else:
            who, problem = None, "missing bearer token"
        if who is None:
            raise _unauthorized(problem)
        route = getattr(request.scope.get("route"), "path", path)  # as declared: /v1/runs/{run_id}/stop
        opening = opening_scopes(method, route)
        if not who.scopes & opening:
            need = " or ".join(f"'{s}'" for s in sorted(opening - {"admin"}) or ["admin"])
            raise HTTPException(403, f"this token lacks the {need} scope")
        request.state.principal = who


class _TooLarge(Exception):
    """Raised into the app by :class:`BodyLimit` when a streamed body passes the cap; answered there."""


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

        async def capped_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(f"request body over {limit} bytes")
            return message

        try:
            await self.app(scope, capped_receive, send)
        except _TooLarge as e:
            await _json(413, {"detail": str(e)})(scope, receive, send)


def _host_matches(host: str, allowed: tuple[str, ...]) -> bool:
    """``host`` (a Host header, lower case) against entries that are ``name`` (any port) or ``name:port``."""
    if host.startswith("["):
        name = host[: host.find("]") + 1]
    else:
        name = host.rsplit(":", 1)[0] if ":" in host else host
    return host in allowed or name in allowed


class BrowserGuard:
    """What a web page in the operator's browser could otherwise do to a service (plain ASGI, before auth).

    - **DNS rebinding**: a page on ``evil.example`` whose name is re-pointed at
      127.0.0.1 reaches a loopback service as same-origin, but its requests
      still say ``Host: evil.example``. Requests whose Host is not in
      ``allowed_hosts`` get 403 (``/healthz`` excepted: probes use pod IPs).
      The port is not checked unless an entry names one: rebinding changes
      the name, never makes the browser send ``localhost``.
    - **Cross-site writes with auth off**: a page may POST ``text/plain``, a
      form, or nothing at all to any URL without a CORS preflight. With
      ``check_writes``, a request other than GET/HEAD/OPTIONS is refused
      (403) unless its ``Content-Type`` is not one of those
      (:data:`SIMPLE_CONTENT_TYPES`: ``application/json`` and
      ``application/x-ndjson`` pass) or it carries :data:`CLIENT_HEADER`;
      either makes a browser ask first, and no CORS preflight is granted.
      With auth on this is not needed: a page cannot attach the bearer
      token, and the session cookie never authorizes a write.
    """

    def __init__(self, app, allowed_hosts: tuple[str, ...] | None, check_writes: bool) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else tuple(h.lower() for h in allowed_hosts)
        self.check_writes = check_writes

    def _problem(self, scope) -> str | None:
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None and scope["path"] not in PUBLIC_PATHS:
            host = headers.get(b"host", b"").decode("latin-1").lower()
            if not _host_matches(host, self.allowed_hosts):
                return f"Host header {host!r} is not allowed here (TANDEM_ALLOWED_HOSTS: {list(self.allowed_hosts)})"
        if self.check_writes and scope["method"] not in SAFE_METHODS and CLIENT_HEADER.lower().encode() not in headers:
            media = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if media in SIMPLE_CONTENT_TYPES:
                return (
                    f"Content-Type {media or '(none)'!r}: without a token, a {scope['method']} must be sent "
                    f"as application/json or application/x-ndjson, or carry an {CLIENT_HEADER} header "
                    "(a web page cannot send either cross-site)"
                )
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (problem := self._problem(scope)) is not None:
            return await _json(403, {"detail": problem})(scope, receive, send)
        return await self.app(scope, receive, send)
