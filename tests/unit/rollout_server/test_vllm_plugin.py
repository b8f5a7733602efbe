"""rollout_server.vllm_plugin: installed as a vLLM general plugin, capping the wait loop's spin only when set."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

# one process (vLLM's import is the cost): a reader that read 0.2 s ago, first without the variable, then with it
CHECK = """
import os, time
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

def reader():
    polled = []
    cond = SpinCondition.__new__(SpinCondition)
    cond.is_reader, cond.busy_loop_s, cond.last_read = True, 1.0, time.monotonic() - 0.2
    cond.poller = type("P", (), {"poll": lambda self, timeout: polled.append(timeout) or {}})()
    cond.read_cancel_socket = cond.local_notify_socket = object()
    cond.wait(timeout_ms=7)
    return cond.busy_loop_s, polled

os.environ.pop("_TANDEM_VLLM_SPIN_S", None)
load_general_plugins()  # what vLLM's engine core and workers do at start
print("unset", *reader())
os.environ["_TANDEM_VLLM_SPIN_S"] = "0.05"
from rollout_server.vllm_plugin import register
register()
print("set", *reader())
"""


@pytest.mark.slow  # over 5 s in make test-fast (docs/testing.md): make test runs it
def test_the_plugin_is_installed_and_when_set_a_reader_past_the_cap_blocks_instead_of_spinning():
    assert "rollout_server.vllm_plugin:register" in {e.value for e in entry_points(group="vllm.general_plugins")}
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()[-2:]
    assert lines == ["unset 1.0 []", "set 0.05 [7]"], done.stdout  # vLLM's own spun; capped, it polled the socket


def test_a_service_started_beside_it_accepts_the_variable():
    """The rollout server sets it in its own environment (vLLM's processes inherit it), and so does a test
    session's engine: a service started from there must not refuse it as an unknown setting."""
    from deploy.settings_reference import settings_classes
    from rollout_server.vllm_plugin import SPIN_VARIABLE
    from services.settings import check_environment

    check_environment(settings_classes().values(), {SPIN_VARIABLE: "0.05"})
