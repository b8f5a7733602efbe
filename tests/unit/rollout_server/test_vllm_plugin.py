"""rollout_server.vllm_plugin: installed as a vLLM general plugin, and capping the wait loop's spin when set."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

CHECK = """
import os, time
os.environ["_TANDEM_VLLM_SPIN_S"] = "0.05"
from vllm.plugins import load_general_plugins
load_general_plugins()  # what vLLM's engine core and workers do at start
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
polled = []
cond = SpinCondition.__new__(SpinCondition)
cond.busy_loop_s, cond.last_read = 1.0, time.monotonic() - 0.2  # read 0.2 s ago: vLLM's own would still spin
cond.poller = type("P", (), {"poll": lambda self, timeout: polled.append(timeout) or {}})()
cond.read_cancel_socket = cond.local_notify_socket = object()
cond.is_reader = True
cond.wait(timeout_ms=7)
print(cond.busy_loop_s, polled)
"""


def test_the_plugin_is_installed_and_a_reader_past_the_cap_blocks_instead_of_spinning():
    assert "rollout_server.vllm_plugin:register" in {e.value for e in entry_points(group="vllm.general_plugins")}
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["0.05", "[7]"], done.stdout  # capped, and it polled the socket


def test_unset_it_changes_nothing():
    unset = CHECK.replace('os.environ["_TANDEM_VLLM_SPIN_S"] = "0.05"', 'os.environ.pop("_TANDEM_VLLM_SPIN_S", None)')
    done = subprocess.run([sys.executable, "-c", unset], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["1.0", "[]"], done.stdout  # vLLM's own: it spun (sched_yield)


def test_a_service_started_beside_it_accepts_the_variable():
    """The rollout server sets it in its own environment (vLLM's processes inherit it), and so does a test
    session's engine: a service started from there must not refuse it as an unknown setting."""
    from deploy.settings_reference import settings_classes
    from rollout_server.vllm_plugin import SPIN_VARIABLE
    from services.settings import check_environment

    check_environment(settings_classes().values(), {SPIN_VARIABLE: "0.05"})
