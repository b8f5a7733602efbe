"""What a Modal container runs: the ``tandem serve`` command line, owned by the container.

A rollout container and a learner node run the very command a local
operator types (``tandem serve rollout --config RUN.toml``;
``torchrun ... -m deploy.cli serve learner --config RUN.toml``), so the CLI's
settings checks, auth check and config loading apply unchanged. The
container owns that process: it starts it in its own process group and,
when it exits, the container exits with its status, so Modal replaces the
container instead of routing to a dead port.

Paths: a run config at ``examples/arith/run.toml`` in the repository is
shipped to ``/examples/arith/run.toml``: the container's repository root is
``/``, so the config's relative paths into ``runs/`` (``../../runs/models/arith``)
land in ``/runs``, the weights volume.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

CONTAINER_ROOT = PurePosixPath("/")
"""The repository root inside a container (``runs/`` there is the mounted volume ``/runs``)."""


def container_path(local: Path, repo_root: Path) -> PurePosixPath:
    """Where ``local`` (a file or directory inside the repository) is shipped in the container."""
    try:
        rel = local.resolve().relative_to(repo_root.resolve())
    except ValueError:
        raise ValueError(f"{local}: the run config must live inside the repository {repo_root}") from None
    return CONTAINER_ROOT.joinpath(*rel.parts)


def serve_argv(service: str, config: str | PurePosixPath) -> list[str]:
    """``tandem serve SERVICE --config CONFIG`` as this interpreter runs it (host, port: TANDEM_HOST/PORT)."""
    return [sys.executable, "-m", "deploy.cli", "serve", service, "--config", str(config)]


def torchrun_argv(*, nodes: int, node_rank: int, master_addr: str | None, nproc_per_node: int,
                  config: str | PurePosixPath) -> list[str]:
    """Every learner rank on this node: ``torchrun ... -m deploy.cli serve learner --config CONFIG``
    (rank 0 serves HTTP; see ``deploy.cli.serve``). One node: no master address (torchrun's local default)."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
            f"--nproc-per-node={nproc_per_node}", f"--node-rank={node_rank}"]
    if nodes > 1:
        if not master_addr:
            raise ValueError("a multi-node learner needs rank 0's address")
        argv.append(f"--master-addr={master_addr}")
    return argv + ["-m", *serve_argv("learner", config)[2:]]


def start(argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own process group; when it exits, end this container with its status."""
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, start_new_session=True)

    def follow() -> None:
        code = proc.wait()
        print(f"{argv[3:5]} exited with {code}: stopping the container", file=sys.stderr, flush=True)
        os._exit(code or 1)  # a server that stopped is a failure for a container that exists to serve

    threading.Thread(target=follow, name="tandem-service", daemon=True).start()
    return proc


def run(argv: list[str], env: Mapping[str, str] | None = None) -> None:
    """Run ``argv`` to completion in its own process group; raise when it fails."""
    code = subprocess.run(argv, env={**os.environ, **(env or {})}, start_new_session=True).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} exited with {code}")
