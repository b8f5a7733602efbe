"""rollout_server.vllm_plugin: installed as a vLLM general plugin; when set, capping the wait loop's spin and pinning the processes vLLM starts."""

from __future__ import annotations

import json
import os
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


# a process vLLM would start (a multiprocessing child, as its engine core and workers are) loads the plugins
PINNED = """
import multiprocessing, os
from vllm.plugins import load_general_plugins

def child(queue):
    load_general_plugins()
    queue.put(sorted(os.sched_getaffinity(0)))

if __name__ == "__main__":
    os.environ["_TANDEM_VLLM_CORES"] = "0"
    load_general_plugins()  # the rollout server's own process keeps every core
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue,))
    p.start()
    print(sorted(os.sched_getaffinity(0)), queue.get(timeout=60))
    p.join()
"""


@pytest.mark.slow  # vLLM's import, twice
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one core shows only on two or more")
def test_given_cores_the_processes_vllm_starts_run_on_them_and_the_server_keeps_its_own(tmp_path):
    script = tmp_path / "pinned.py"
    script.write_text(PINNED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    server, child = json.loads("[" + done.stdout.strip().splitlines()[-1].replace("] [", "], [") + "]")
    assert server == sorted(os.sched_getaffinity(0)) and child == [0], done.stdout


def test_the_cores_are_read_from_vllms_thread_binding_of_one_rank():
    from rollout_server.vllm_plugin import bound_cores

    assert bound_cores("0") == [0] and bound_cores("0-3") == [0, 1, 2, 3] and bound_cores("0,2-3") == [0, 2, 3]
    assert [bound_cores(b) for b in ("auto", "nobind", "0-1|2-3", "", None)] == [None] * 5
