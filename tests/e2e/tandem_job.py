"""``tandem run`` of an example as a user runs it, from the tests of the examples: a child process with the
caller's environment less its TANDEM_ settings, and what a killed run leaves stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tandem_run(config: Path, runs: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """``tandem run CONFIG --runs RUNS`` with ``env`` over the caller's environment (less its ``TANDEM_*`` and
    ``REDIS_URL``); past ``timeout_s`` it is killed with its stack (:func:`stop_stack`) and the timeout raised.
    Prints the tails of its output and its wall time."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    t0 = time.monotonic()
    job = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(config), "--runs", str(runs)], cwd=ROOT,
                           env=base | env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        stop_stack(job.pid, runs)  # its services have process groups of their own: they outlive it
        raise
    print(stdout[-3000:], stderr[-3000:], f"\ntandem run: {time.monotonic() - t0:.0f} s", sep="\n")
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def stop_stack(pid: int, runs: Path) -> None:
    """Kill what a killed ``tandem run`` (process ``pid``) left: its services and Redis, tagged in their
    environment with ``OWNER_VARIABLE=PID-...`` (tests/integration/deploy/test_main_job.py reads the same),
    and vLLM's engine processes, which carry only ``TANDEM_RUN_DIR`` (a stack directory under ``runs``)."""
    from host.processes import OWNER_VARIABLE

    variable, mine, run_dir = f"{OWNER_VARIABLE}=".encode(), f"{pid}-".encode(), f"TANDEM_RUN_DIR={runs}/".encode()

    def left_by_it(value: bytes) -> bool:
        tagged = value.startswith(variable) and any(t.startswith(mine) for t in value[len(variable):].split(b"/"))
        return tagged or value.startswith(run_dir)

    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(map(left_by_it, (entry / "environ").read_bytes().split(b"\0"))):
                os.kill(int(entry.name), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
