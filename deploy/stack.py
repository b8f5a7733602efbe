"""The local stack: embedded Redis plus every service as a supervised child.

``tandem up`` and ``tandem run`` use :class:`Stack`. It

- starts Redis (embedded ``redis-server`` unless ``REDIS_URL`` is set), then
  each service as ``tandem serve NAME`` on a free port (``rollouts`` rollout
  servers; the learner under ``torchrun`` when it has more than one rank),
  all in their own
  process groups with ``PR_SET_PDEATHSIG`` (so they die with the
  supervisor even if it is killed -9), with the URLs, token and run
  directory passed as ``TANDEM_*`` variables;
- starts them all at once (each needs only Redis to start) and waits until
  each answers ``/healthz``: the stack is up in its slowest service's time;
- streams their output, each line prefixed with the service name, to the
  console and to ``<run_dir>/logs/NAME.log``;
- restarts a service that exits unexpectedly, with exponential back-off, at
  most ``max_restarts`` times per service, and the embedded Redis at once on
  its AOF and port (the services' clients reconnect: ``broker.connect``);
  beyond that the stack fails; ``stack.json`` names the current pids;
- gives each service but the reward server its own ``TMPDIR`` (in one
  ``tandem-stack-*`` directory; vLLM leaves IPC sockets there), emptied
  whenever the service starts and removed at the end; torch.compile's cache
  is the user's (``~/.cache/tandem/torchinductor``), kept from run to run;
- before restarting a service that exited, SIGKILLs whatever it started
  that is still alive (a rollout server killed -9 leaves vLLM's engine core;
  torchrun's ranks have sessions of their own): every process the stack
  starts carries ``_TANDEM_OWNER`` in its environment, which descendants
  inherit (``host.processes.owned_by``);
- on :meth:`stop` (Ctrl-C, SIGTERM) sends SIGTERM to each service, SIGKILL
  to its whole process group after a grace period, then stops Redis.

Other local users are not trusted (docs/architecture.md section 7). The run
directory holds the token (``stack.json``), the embedded Redis's data and
the weights, so the stack makes it 0700 and the services that write there run with
umask 077 (every file they write is 0600). The embedded Redis requires a password
(:mod:`broker.embedded`); the URL that carries it goes only to the services'
environment (private to the user, unlike argv) and to ``stack.json`` (0600,
:meth:`Stack.write_info`); the console and logs get it without the password.
The reward server never gets ``REDIS_URL``: it has no use for Redis, and it
is the process that runs untrusted code (in sandboxes); it also keeps the
caller's umask, since its sandboxes run under other uids.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from broker.embedded import EmbeddedRedis
from deploy.cpu_account import CpuAccountant
from deploy.launch import serve_argv, torchrun_argv
from deploy.settings import StackSettings
from host.files import write_atomic
from host.processes import (
    OWNER_VARIABLE,
    die_with_parent,
    free_port,
    group_members,
    owned_by,
    owner_tag,
    stop_group,
    stop_groups,
)

SERVICES = ("reward", "control", "rollout", "learner")
# Set per service by the stack; a value in the caller's environment would be wrong for all but one.
_STACK_DECIDES = {"TANDEM_PORT", "TANDEM_HOST", "TANDEM_RUN_ID", "TANDEM_SERVER_ID", "TANDEM_TOKENS",
                  "TANDEM_LEARNER_HOLDER"}
# The service that runs untrusted code (in sandboxes): it uses no Redis, so it gets no REDIS_URL
# (nor the Redis password), and it keeps the caller's umask (its sandboxes hand files to other uids).
_RUNS_SANDBOXES = {"reward"}
STACK_FILE = "stack.json"
LOCK_FILE = "stack.lock"
"""Held (flock) by the stack that owns the run directory; it holds that stack's pid."""
START_TIMEOUT_S = {"reward": 60, "control": 60, "rollout": 600, "learner": 300}
"""Seconds from spawn to healthy. vLLM's start (three processes, each importing torch and vLLM) took 16 s
on a quiet 2-core machine, 135 s to more than 300 s on one with a load average of 8-27."""


@dataclass
class Child:
    name: str
    """``rollout``, ``rollout-2``, ...: the service and, beyond the first of a kind, its number."""
    port: int
    env: dict[str, str]
    args: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    log_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]


class StackError(RuntimeError):
    """The stack could not start, or a service kept crashing."""


class Stack:
    def __init__(
        self,
        run_dir: str | Path,
        settings: StackSettings | None = None,
        *,
        config: str | Path | None = None,
        services: tuple[str, ...] = SERVICES,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings or StackSettings()
        self.run_dir = Path(run_dir).resolve()
        self.config = Path(config).resolve() if config else None
        self.token = self.settings.token.get_secret_value() if self.settings.token else secrets.token_urlsafe(24)
        self.external_redis = self.settings.redis_url
        self.services = services
        self.max_restarts = self.settings.max_restarts
        self.echo = echo or (lambda line: print(line, flush=True))
        self.redis: EmbeddedRedis | None = None
        self.redis_url = self.external_redis or ""
        self.children: dict[str, Child] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._owner: int | None = None  # fd of the run directory's lock file while this stack holds it
        self._info_owner: int | None = None  # the pid write_info recorded: stack.json is kept current
        self.redis_restarts = 0
        self._tmp_root: Path | None = None  # the services' TMPDIRs (mkdtemp, 0700), removed at stop
        self._tag = owner_tag(f"{os.getpid()}-{secrets.token_hex(4)}")  # marks every process this stack starts
        self.cpu = CpuAccountant(self)  # the CPU account of the run it works on, kept by check()

    # -- start -------------------------------------------------------------

    def start(self) -> Stack:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)  # an existing run directory too: it is about to hold secrets
        (self.run_dir / "logs").mkdir(mode=0o700, exist_ok=True)
        self._own_run_dir()
        try:
            if not self.external_redis:
                self.redis = EmbeddedRedis(self.run_dir / "redis").start()
                self.redis_url = self.redis.url
                self.echo(f"[stack] redis-server at {self.redis.display_url} (AOF in {self.redis.data_dir})")
            names = [n for kind in self.services
                     for n in ([kind] + [f"{kind}-{i}" for i in range(2, self.settings.rollouts + 1)]
                               if kind == "rollout" else [kind])]
            ports = {name: free_port() for name in names}
            env = self._env(ports)
            for name in names:
                kind = name.split("-")[0]
                if kind == "learner" and self.settings.learner_ranks > 1:
                    args = torchrun_argv(nproc_per_node=self.settings.learner_ranks, master_port=free_port(),
                                         config=self.config, port=ports[name])
                else:
                    args = serve_argv(kind, self.config, port=ports[name])
                own_env = {k: v for k, v in env.items() if k != "REDIS_URL"} if kind in _RUNS_SANDBOXES else env
                self.children[name] = Child(name, ports[name], own_env, args)
            # every service needs only Redis to start (the rollout server calls the reward server once
            # it serves a run), so all start at once: the stack is up in its slowest service's time
            for name in names:
                self._spawn(self.children[name])
            self._wait_healthy(*(self.children[name] for name in names))
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self, ports: dict[str, int]) -> dict[str, str]:
        """The services' environment: the caller's (their own TANDEM_<SERVICE>_* settings pass
        through), with what the stack decides for every service set here."""
        env = {k: v for k, v in os.environ.items() if k not in _STACK_DECIDES}
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self._inductor_cache()))
        env.update({
            "TANDEM_TOKEN": self.token,
            "TANDEM_HOST": "127.0.0.1",
            "REDIS_URL": self.redis_url,
            "TANDEM_RUN_DIR": str(self.run_dir),
            "PYTHONUNBUFFERED": "1",
            # the stack's learner, whichever process it is: one restarted after a crash takes over its
            # predecessor's run lease at once instead of waiting for it to expire (broker.lease); no
            # other stack has this id (each holds its run directory's lock)
            "TANDEM_LEARNER_HOLDER": f"{socket.gethostname()}:stack:{self.run_dir}",
        })
        # the stack's one client is the operator, on this disk: a model may be in any folder (unless the
        # caller's environment narrows it; a deployed control plane allows its run directory only)
        env.setdefault("TANDEM_CONTROL_MODEL_DIRS", '["/"]')
        if "reward" in ports:
            env["TANDEM_ROLLOUT_REWARD_URL"] = f"http://127.0.0.1:{ports['reward']}"
            env["TANDEM_CONTROL_REWARD_URL"] = env["TANDEM_ROLLOUT_REWARD_URL"]  # /v1/check at upload
        return env

    def _inductor_cache(self) -> Path:
        """Where torch.compile keeps what it built: the user's cache, so that every run after the first
        finds it (vLLM compiles its log-prob ranking on its first generation; docs/performance.md, "Fixed
        costs", has that generation's time with and without the cache), not the services' TMPDIRs, emptied whenever a
        service starts. The run directory if that cache cannot be made."""
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "torchinductor"
        try:
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return self.run_dir / "cache" / "torchinductor"
        return cache

    def _spawn(self, child: Child) -> None:
        tmp = self._tmp(child)
        if tmp is not None:
            self._fresh_tmp(child)
        child.proc = subprocess.Popen(
            child.args,
            env={**cpu_split(child.kind), **child.env, "TANDEM_SERVER_ID": child.name,
                 OWNER_VARIABLE: self._owner_tag(child),
                 **({"TMPDIR": str(tmp)} if tmp is not None else {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=-1 if child.kind in _RUNS_SANDBOXES else 0o077,  # weights, checkpoints, logs: 0600
            preexec_fn=die_with_parent,
        )
        child.started_at = time.monotonic()
        log = open(self.run_dir / "logs" / f"{child.name}.log", "a", buffering=1, opener=_private)  # noqa: SIM115
        child.log_thread = threading.Thread(target=self._pump, args=(child, child.proc, log), daemon=True)
        child.log_thread.start()

    def _pump(self, child: Child, proc: subprocess.Popen, log) -> None:
        with log:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                log.write(line + "\n")
                self.echo(f"[{child.name}] {line}")

    def _wait_healthy(self, *children: Child) -> None:
        """Wait for ``children`` together; :class:`StackError` naming the first that exits or times out,
        and its log."""
        def ready(name: str) -> None:
            child = self.children[name]
            self.echo(f"[stack] {name} ready at {child.url} in {time.monotonic() - child.started_at:.1f} s")

        try:
            wait_all_healthy({c.name: (c.proc, c.url, START_TIMEOUT_S.get(c.kind, 120)) for c in children}, ready)
        except NotHealthy as e:
            raise StackError(f"{e.name} {e.problem}; see {self.run_dir / 'logs' / (e.name + '.log')}") from None

    # -- supervise ---------------------------------------------------------

    def check(self) -> None:
        """Restart crashed services (with back-off) and a crashed embedded Redis (at once, on its AOF and
        port); raise :class:`StackError` past the limit."""
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None \
                and not self._stopping.is_set():
            code = self.redis.proc.returncode
            self.redis_restarts += 1
            if self.redis_restarts > self.max_restarts:
                raise StackError(f"redis-server exited with code {code} after {self.redis_restarts - 1} restarts")
            self.echo(f"[stack] redis-server exited with code {code}; restarting it on its AOF "
                      f"({self.redis_restarts}/{self.max_restarts})")
            self.redis.start()
            self._rewrite_info()
        for child in self.children.values():
            if self._stopping.is_set() or child.proc is None or child.proc.poll() is None:
                continue
            code = child.proc.returncode
            if child.restarts >= self.max_restarts:
                raise StackError(f"{child.name} exited with code {code} after {child.restarts} restarts")
            child.restarts += 1
            delay = min(30.0, self.settings.restart_backoff_s * 2.0 ** (child.restarts - 1))
            left = self._end_group(child)
            self.echo(f"[stack] {child.name} exited with code {code}"
                      + (f" ({left} processes of its group killed)" if left else "")
                      + f"; restart {child.restarts}/{self.max_restarts} in {delay:g} s")
            if self._stopping.wait(delay):
                return
            self._spawn(child)
            self._wait_healthy(child)
            self._rewrite_info()
        if not self._stopping.is_set():
            self.cpu.record()

    def _end_group(self, child: Child) -> int:
        """After ``child`` exited: SIGKILL whatever it started that is still alive, in its process
        group or not (vLLM's engine core outlives a rollout server killed -9; torchrun's ranks have
        sessions of their own), and empty its temporary directory; how many were left."""
        tag = self._owner_tag(child)
        left = set(group_members(child.proc.pid)) | set(owned_by(tag))
        stop_group(child.proc, grace_s=0, owner=tag)
        self._fresh_tmp(child)
        return len(left)

    def _owner_tag(self, child: Child | None = None) -> str:
        """The value of ``OWNER_VARIABLE`` in this stack's processes (one child's, or all of them)."""
        return f"{self._tag}/{child.name}" if child is not None else self._tag

    def _tmp(self, child: Child) -> Path | None:
        """The child's own TMPDIR (None for the reward server: its sandboxes, run as other uids, keep
        the system's). Under the system's temporary directory, not the run directory: vLLM puts its
        IPC sockets there, whose paths may not exceed 107 bytes."""
        if child.kind in _RUNS_SANDBOXES:
            return None
        if self._tmp_root is None:
            self._tmp_root = Path(tempfile.mkdtemp(prefix="tandem-stack-"))
        return self._tmp_root / child.name

    def _fresh_tmp(self, child: Child) -> None:
        tmp = self._tmp(child)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700, parents=True)

    def supervise(self, until: Callable[[], bool] | None = None, poll_s: float = 1.0) -> None:
        """Keep the stack up until ``until()`` is true or :meth:`stop` is called."""
        while not self._stopping.is_set():
            self.check()
            if until is not None and until():
                return
            self._stopping.wait(poll_s)

    # -- stop --------------------------------------------------------------

    def stop(self) -> None:
        """End every child's process group, then Redis. Safe to call twice."""
        with self._lock:
            self._stopping.set()
            started = [c for c in self.children.values() if c.proc is not None]
            names = {c.proc.pid: c.name for c in started}
            # the stack's tag: what left its process group too (torchrun's ranks)
            stop_groups([c.proc for c in reversed(started)], self.settings.stop_grace_s, owner=self._owner_tag(),
                        on_timeout=lambda p: self.echo(f"[stack] {names[p.pid]} ignored SIGTERM; killing it"))
            for child in started:
                if child.log_thread is not None:
                    child.log_thread.join(timeout=5)
            if self._tmp_root is not None:
                shutil.rmtree(self._tmp_root, ignore_errors=True)
                self._tmp_root = None
            self.cpu.close()
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
            if self._owner is not None:
                os.close(self._owner)  # releases the lock
                self._owner = None

    def _own_run_dir(self) -> None:
        """Hold ``<run_dir>/stack.lock`` (an exclusive ``flock``) for the stack's life, or refuse:
        two stacks on one run directory would run two redis-servers on one AOF. The kernel drops
        the lock with the process, so a stack killed with -9 leaves nothing to clean up."""
        import fcntl

        fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StackError(f"another tandem stack (pid {holder}) is using {self.run_dir}: "
                             "stop it first, or give this one another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._owner = fd

    def url(self, name: str) -> str:
        return self.children[name].url

    def write_info(self, owner_pid: int) -> Path:
        """Write ``<run_dir>/stack.json`` (the services' URLs, the token, the Redis URL with its
        password, the pids) as a new 0600 file; return its path. ``owner_pid``: the supervising process.

        The file is written under a temporary name created 0600 and renamed over the old one, so it
        is never readable by others, even for a moment, whatever mode an older file had.
        """
        self._info_owner = owner_pid
        info = {"urls": {name: self.url(name) for name in self.children}, "token": self.token,
                "pid": owner_pid, "pids": self.pids(), "redis_url": self.redis_url,
                "services": {name: c.proc.pid for name, c in self.children.items() if c.proc is not None}
                | ({"redis": self.redis.proc.pid} if self.redis is not None and self.redis.proc else {})}
        path = self.run_dir / STACK_FILE
        write_atomic(path, json.dumps(info), mode=0o600)
        return path

    def _rewrite_info(self) -> None:
        """After a restart: stack.json names the new pids (if it was written)."""
        if self._info_owner is not None:
            self.write_info(self._info_owner)

    def pids(self) -> list[int]:
        """Every process id the stack started (services and Redis)."""
        pids = [c.proc.pid for c in self.children.values() if c.proc is not None]
        if self.redis is not None and self.redis.proc is not None:
            pids.append(self.redis.proc.pid)
        return pids

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _private(path: str, flags: int) -> int:
    """``open`` opener: the file is 0600 (an existing one too)."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def cpu_split(service: str, cores: int | None = None) -> dict[str, str]:
    """Thread settings that keep the rollout engine and the learner off each other's cores.

    vLLM's CPU backend pins its OpenMP threads; left alone, it and the
    learner's torch threads would both spin on every core. The rollout
    server gets the first half of the cores (its worker's threads, and its
    engine core: ``rollout_server.vllm_plugin``), the learner the rest, and the
    rollout server's too while no group is in flight (it waits for room:
    ``learner.borrowed_cores``); the reward server's sandboxes and the
    control plane are mostly idle. An explicit setting in the environment
    wins (the caller's env is applied after this).
    """
    cores = cores or os.cpu_count() or 1
    rollout = max(1, cores // 2)
    if service == "rollout":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{rollout - 1}" if rollout > 1 else "0"}
    if service == "learner":
        return {"OMP_NUM_THREADS": str(max(1, cores - rollout)),
                "TANDEM_LEARNER_BORROW_THREADS": str(rollout if cores > 1 else 0)}
    return {}


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path | None = None) -> None:
    """Wait until ``url``/healthz answers 200; :class:`StackError` if ``proc`` exits first or
    ``timeout_s`` passes (with the tail of ``log`` when given)."""
    try:
        wait_all_healthy({"": (proc, url, timeout_s)})
    except NotHealthy as e:
        problem = e.problem
        if log is not None:
            problem += "\n" + log.read_bytes()[-3000:].decode(errors="replace")
        raise StackError(problem) from None


class NotHealthy(Exception):
    """A process of :func:`wait_all_healthy` exited or timed out before it answered."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem


def wait_all_healthy(procs: dict[str, tuple[subprocess.Popen, str, float]],
                     ready: Callable[[str], None] = lambda name: None) -> None:
    """Wait until each named ``(process, url, timeout_s)`` answers ``url``/healthz with 200, all at
    once, calling ``ready(name)`` as each does; :class:`NotHealthy` for the first that exits or
    passes its timeout (counted from this call)."""
    t0 = time.monotonic()
    waiting = dict(procs)
    while waiting:
        for name, (proc, url, timeout_s) in list(waiting.items()):
            if proc.poll() is not None:
                raise NotHealthy(name, f"exited with code {proc.returncode} while starting")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                    del waiting[name]
                    ready(name)
                    continue
            if time.monotonic() - t0 > timeout_s:
                raise NotHealthy(name, f"did not become healthy in {timeout_s:g} s")
        if waiting:
            time.sleep(0.3)
