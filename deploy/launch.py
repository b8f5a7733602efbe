"""The ``tandem serve`` command lines, built here only, and how a Modal container owns the one it runs.

:func:`serve_argv` and :func:`torchrun_argv` are the command lines of every service process: the
local stack (``deploy.stack``) starts each service with them, a Modal container
(``deploy.modal_app``) runs them, and the learner's test fixture starts the learner the way the
stack does. A rollout container and a learner node run the very command a local
operator types (``tandem serve rollout --config RUN.toml``;
``torchrun ... -m deploy.cli serve learner --config RUN.toml``), so the CLI's
settings checks, auth check and config loading apply unchanged. The
container owns that process (:func:`start`, :func:`run`): it starts it in its own process group and,
when it exits, the container exits with its status, so Modal replaces the
container instead of routing to a dead port.

Signals: Modal sends SIGTERM to the container's main process (scale-down,
preemption, the call's timeout); a child in a session of its own never sees
it. :func:`forward_signals` (installed by :func:`start` and :func:`run` when
called from the main thread, and by ``deploy.modal_app`` when the container
imports it) passes SIGTERM on to each service's process group, so the learner
saves its checkpoint and a rollout server ends its leases before Modal's
grace period runs out. A learner job that stopped on SIGTERM raises
:class:`Interrupted` even when it exited cleanly: the call failed, and Modal
retries it (the retry resumes from the checkpoint).

Paths: a run config at ``examples/arith/run.toml`` in the repository is
shipped to ``/examples/arith/run.toml``: the container's repository root is
``/``, so the config's relative paths into ``runs/`` (``../../runs/models/arith``)
land in ``/runs``, the weights volume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path, PurePath, PurePosixPath

from host.processes import stop_group

CONTAINER_ROOT = PurePosixPath("/")
"""The repository root inside a container (``runs/`` there is the mounted volume ``/runs``)."""


def container_path(local: Path, repo_root: Path) -> PurePosixPath:
    """Where ``local`` (a file or directory inside the repository) is shipped in the container."""
    try:
        rel = local.resolve().relative_to(repo_root.resolve())
    except ValueError:
        raise ValueError(f"{local}: the run config must live inside the repository {repo_root}") from None
    return CONTAINER_ROOT.joinpath(*rel.parts)


def serve_argv(service: str, config: str | PurePath | None = None, *, port: int | None = None) -> list[str]:
    """``tandem serve SERVICE [--port PORT] [--config CONFIG]`` as this interpreter runs it (without a
    port: TANDEM_PORT, as in a container; without a config: the service's default)."""
    argv = [sys.executable, "-m", "deploy.cli", "serve", service]
    if port is not None:
        argv += ["--port", str(port)]
    if config is not None:
        argv += ["--config", str(config)]
    return argv


def torchrun_argv(*, nproc_per_node: int, config: str | PurePath | None = None, port: int | None = None,
                  nodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                  master_port: int | None = None) -> list[str]:
    """Every learner rank on this node: ``torchrun ... -m deploy.cli serve learner [--port PORT] [--config
    CONFIG]`` (rank 0 serves HTTP; see ``deploy.cli.serve``). One node: no master address (torchrun's
    local default); ``master_port``: the rendezvous port (torchrun's default, 29500, when None), which
    two jobs on one host must not share."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
            f"--nproc-per-node={nproc_per_node}", f"--node-rank={node_rank}"]
    if nodes > 1:
        if not master_addr:
            raise ValueError("a multi-node learner needs rank 0's address")
        argv.append(f"--master-addr={master_addr}")
    if master_port is not None:
        argv.append(f"--master-port={master_port}")
    return argv + ["-m", *serve_argv("learner", config, port=port)[2:]]


CANCEL_GRACE_S = 30.0
"""How long a cancelled service may take to stop (the learner checkpoints) before it is killed."""
_services: list[subprocess.Popen] = []
"""Service processes this container started (each leads its own process group)."""
_received: list[int] = []
"""Signals this process received and passed on."""


def forward_signals() -> bool:
    """Pass SIGTERM on to every service process group started here (idempotent). Python installs
    handlers in the main thread only: False elsewhere (``deploy.modal_app`` installs it at import)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not _forward:
        signal.signal(signal.SIGTERM, _forward)
    return True


def _forward(signum: int, _frame) -> None:
    _received.append(signum)
    for proc in _services:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass  # it exited meanwhile


class Interrupted(RuntimeError):
    """The service stopped because this container was told to stop (SIGTERM), not because its work ended."""


def _spawn(argv: list[str], env: Mapping[str, str] | None) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, start_new_session=True)
    _services.append(proc)
    forward_signals()
    return proc


def start(argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own process group; when it exits, end this container with its status."""
    proc = _spawn(argv, env)

    def follow() -> None:
        code = proc.wait()
        print(f"{argv[3:5]} exited with {code}: stopping the container", file=sys.stderr, flush=True)
        os._exit(code or 1)  # a server that stopped is a failure for a container that exists to serve

    threading.Thread(target=follow, name="tandem-service", daemon=True).start()
    return proc


def run(argv: list[str], env: Mapping[str, str] | None = None) -> None:
    """Run ``argv`` to completion in its own process group; raise when it fails, and
    :class:`Interrupted` when it stopped on a signal this process passed on. An exception raised while
    it runs (Modal raises ``InputCancellation`` in the main thread when the call is cancelled) stops
    its process group first (SIGTERM, ``CANCEL_GRACE_S``, then SIGKILL): a torchrun left behind would
    keep training and renewing the run's lease."""
    proc = _spawn(argv, env)
    try:
        code = proc.wait()
    except BaseException:  # Modal's InputCancellation (a cancelled call), KeyboardInterrupt: end the service too
        stop_group(proc, grace_s=CANCEL_GRACE_S)
        raise
    if _received:
        raise Interrupted(f"{' '.join(argv[1:])} stopped on signal {_received[0]} (exit {code})")
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} exited with {code}")
