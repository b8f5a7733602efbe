"""Running a service's app with uvicorn, and failing loudly when its port cannot be had.

:func:`serve` / :func:`run_server` run an app (``services.app.create_app``) with uvicorn; a port that
cannot be listened on ends the process with :data:`EXIT_STARTUP_FAILED` and
one line naming it, before the lifespan starts anything when the port is
taken already, else (taken while the lifespan started, e.g. a vLLM engine)
once uvicorn has shut the lifespan down again. Every ``tandem serve`` goes through here.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from services.settings import CommonSettings


EXIT_STARTUP_FAILED = 3
"""Exit status of a service that did not start: its port could not be listened on, or its lifespan
failed (uvicorn's own status for both)."""


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None if it can.

    Binds and listens the way uvicorn's asyncio server will (every address
    ``host`` resolves to, ``SO_REUSEADDR``, IPv6 sockets v6-only), then
    lets go: a port held by another listener is refused, one in TIME_WAIT
    is not.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on {host}:{port}: cannot resolve {host!r} ({e.strerror})"
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                sock.listen(1)
            except OSError as e:
                return f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()}"
    return None


def _startup_failed(name: str, problem: str) -> NoReturn:
    print(f"{name}: {problem}", file=sys.stderr, flush=True)
    sys.exit(EXIT_STARTUP_FAILED)


def run_server(server: uvicorn.Server, name: str) -> None:
    """Run ``server`` (blocks); a port it cannot listen on exits :data:`EXIT_STARTUP_FAILED` with one
    line, ``<name>: cannot listen on <host>:<port>: <reason>``.

    The port is checked first, so a port that is taken already stops the
    service before its lifespan starts anything (a vLLM engine takes tens of
    seconds). A port taken while the lifespan starts (vLLM binds ports of its
    own meanwhile) fails uvicorn's bind; uvicorn then runs the lifespan's
    shutdown (the rollout server ends its engine core) and exits, and the
    line naming the port comes last.
    """
    config = server.config
    if (problem := port_problem(config.host, config.port)) is not None:
        _startup_failed(name, problem)
    try:
        server.run()
    except SystemExit:
        if not server.started and (problem := port_problem(config.host, config.port)) is not None:
            _startup_failed(name, f"{problem} (taken while the service started; it has stopped again)")
        raise


def log_to_stderr(level: str) -> None:
    """The service's own log lines (tandem's loggers, not only uvicorn's) on stderr at ``level``
    (``TANDEM_LOG_LEVEL``), e.g. the reward server's "code runs in gVisor (runsc)" at start-up."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(app: FastAPI, settings: CommonSettings) -> None:
    """Run ``app`` with uvicorn on the settings' host and port (blocks); see :func:`run_server`."""
    import uvicorn

    log_to_stderr(settings.log_level)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False)
    run_server(uvicorn.Server(config), app.title)
