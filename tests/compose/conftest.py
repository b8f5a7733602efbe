"""Fixtures of the compose tests (``make compose-test``): a Docker engine and the CPU profile's images.

Both are session-wide: the stack test and the code test share one image build."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sh(*args: str, env: dict | None = None, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def docker_ready() -> bool:
    if shutil.which("docker") is None:
        return False
    info = subprocess.run(["docker", "info"], capture_output=True, check=False)
    compose = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return info.returncode == 0 and compose.returncode == 0


@pytest.fixture(scope="session")
def docker():
    """A Docker engine with Compose v2 (no runsc runtime: the reward container runs runsc itself), set up
    here when missing and allowed."""
    if not docker_ready():
        if os.geteuid() != 0 or os.environ.get("TANDEM_DOCKER_SETUP") == "0":
            pytest.skip("needs Docker with Compose v2, or root to set them up (deploy/docker-setup.sh)")
        sh("sh", "deploy/docker-setup.sh", timeout=900)
        assert docker_ready()


@pytest.fixture(scope="session")
def images(docker):
    sh("sh", "deploy/image.sh", timeout=2400)


