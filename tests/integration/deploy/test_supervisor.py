"""The supervisor restarts a crashed service with growing delays, then gives up (deploy/stack.py).

A real ``tandem up --only reward`` (embedded Redis and the reward server, the
quickest service to start) with ``TANDEM_STACK_MAX_RESTARTS=2`` and
``TANDEM_STACK_RESTART_BACKOFF_S=0.5``: the reward server is killed -9 three
times. The first two kills are followed by a restart no sooner than the
back-off (0.5 s, then doubled: 1 s, measured from the kill to the new process's
start time in ``/proc``); the third ends ``tandem up`` with
exit code 1 and a message naming the service and the restarts, and leaves no
process of the stack behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from host.processes import group_members

ROOT = Path(__file__).resolve().parents[3]


def _started_s(pid: int) -> float:
    """When ``pid`` started, in seconds of CLOCK_BOOTTIME (field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")


def _info(stack_dir: Path) -> dict:
    while True:  # rewritten atomically after each restart
        try:
            return json.loads((stack_dir / "stack.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.1)


def _wait(predicate, timeout_s: float, what: str, up: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert up.poll() is None or what == "exit", f"tandem up exited waiting for {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    return value


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow  # over 9 s: make test, not make test-fast
def test_a_killed_service_is_restarted_with_back_off_until_max_restarts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    env["TANDEM_STACK_MAX_RESTARTS"] = "2"
    env["TANDEM_STACK_RESTART_BACKOFF_S"] = "0.5"  # the default 2 s would only make the test wait longer
    stack_dir, log = tmp_path / "stack", tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--only", "reward", "--run-dir", str(stack_dir)],
                          cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: (stack_dir / "stack.json").exists(), 120, "the stack", up, log)
        url = _info(stack_dir)["urls"]["reward"]
        started = [_info(stack_dir)["services"]["reward"]]
        redis_pid = _info(stack_dir)["services"]["redis"]
        delays = []
        for restart in (1, 2):
            _wait(lambda: _healthy(url), 60, "the reward server", up, log)
            old = started[-1]
            os.kill(old, signal.SIGKILL)
            killed_at = time.clock_gettime(time.CLOCK_BOOTTIME)
            new = _wait(lambda old=old: (pid := _info(stack_dir)["services"]["reward"]) != old and pid, 60,
                        f"restart {restart}", up, log)
            delays.append(_started_s(new) - killed_at)
            started.append(new)
        _wait(lambda: _healthy(url), 60, "the reward server after 2 restarts", up, log)
        os.kill(started[-1], signal.SIGKILL)  # past max_restarts: the stack fails
        code = up.wait(timeout=60)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    out = log.read_text()
    print(f"restart delays after kill -9: {[round(d, 2) for d in delays]} s")
    # back-off 0.5 s then 1 s (lower bounds: a loaded machine only makes them later; /proc gives the
    # start time in clock ticks, rounded down)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert delays[0] >= 0.5 - tick and delays[1] >= 1.0 - tick, delays
    assert "restart 1/2 in 0.5 s" in out and "restart 2/2 in 1 s" in out, out[-3000:]
    assert code == 1, out[-3000:]
    assert "reward exited with code -9 after 2 restarts" in out, out[-3000:]
    assert not [p for pid in [*started, redis_pid] for p in group_members(pid)], "a process of the stack is left"
