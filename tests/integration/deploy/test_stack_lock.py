"""One stack per run directory: a second `tandem up` on it refuses, naming the first; the lock goes with
the first stack, even one killed with -9 (two stacks would run two redis-servers on one AOF)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.processes import stop_group

ROOT = Path(__file__).resolve().parents[3]


def _up(run_dir: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--only", "control", "--run-dir", str(run_dir)],
                            cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def _wait_up(proc: subprocess.Popen, run_dir: Path, log: Path) -> None:
    deadline = time.monotonic() + 120
    while not (run_dir / "stack.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
def test_a_second_stack_on_one_run_directory_refuses_and_the_lock_goes_with_the_first(tmp_path):
    run_dir = tmp_path / "stack"
    first = _up(run_dir, tmp_path / "first.log")
    try:
        _wait_up(first, run_dir, tmp_path / "first.log")
        second = _up(run_dir, tmp_path / "second.log")
        try:
            assert second.wait(timeout=60) == 1
        finally:
            stop_group(second)
        said = (tmp_path / "second.log").read_text()
        assert f"another tandem stack (pid {first.pid}) is using {run_dir}" in said, said
        assert first.poll() is None  # the first stack is untouched
        os.killpg(first.pid, signal.SIGKILL)  # the kernel drops the lock with the process
        first.wait(timeout=30)
    finally:
        stop_group(first)
    (run_dir / "stack.json").unlink()
    third = _up(run_dir, tmp_path / "third.log")
    try:
        _wait_up(third, run_dir, tmp_path / "third.log")
    finally:
        stop_group(third)
    assert third.returncode is not None
