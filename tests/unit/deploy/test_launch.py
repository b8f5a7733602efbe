"""deploy.launch: the service command lines the local stack and a Modal container share, as the CLI and torchrun parse them."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from deploy import launch


def _serve_params(argv: list[str]) -> dict:
    from deploy.cli import app as cli

    assert argv[:2] == ["serve", argv[1]]
    return typer.main.get_command(cli).commands["serve"].make_context("serve", argv[1:]).params


def test_serve_with_a_port_and_no_config_as_the_stack_starts_a_service():
    argv = launch.serve_argv("reward", port=4321)
    assert argv[:3] == [sys.executable, "-m", "deploy.cli"]
    params = _serve_params(argv[3:])
    assert params["name"].value == "reward" and params["port"] == 4321 and params["config"] is None


def test_a_local_multi_rank_learner_gets_its_own_rendezvous_port():
    from torch.distributed.run import get_args_parser

    argv = launch.torchrun_argv(nproc_per_node=2, master_port=29611, port=4322, config=Path("/tmp/run.toml"))
    args = get_args_parser().parse_args(argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_port) == ("1", "2", 0, 29611)
    assert args.module and args.training_script == "deploy.cli"
    params = _serve_params(args.training_script_args)
    assert params["name"].value == "learner" and params["port"] == 4322
    assert params["config"] == Path("/tmp/run.toml")


SERVICE = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write("checkpoint saved on SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".up", "w").write("up")
time.sleep(60)
"""

ENTRYPOINT = """
import sys
from deploy import launch
try:
    launch.run([sys.executable, "-c", sys.argv[1], sys.argv[2]])
except launch.Interrupted as e:
    print("interrupted:", e, flush=True)
    sys.exit(3)
"""


def test_sigterm_to_the_container_entrypoint_reaches_the_service_and_fails_the_call(tmp_path):
    """Modal sends SIGTERM to the container's main process only; the service runs in its own process
    group (start_new_session), so without forwarding it never learns that it must save its work (the
    learner's checkpoint). The entrypoint passes it on, waits, and fails the call so Modal retries it."""
    import subprocess
    import time

    from host.processes import die_with_parent, stop_group

    marker, log = tmp_path / "saved", tmp_path / "entrypoint.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", ENTRYPOINT, SERVICE, str(marker)], cwd=Path(__file__).parents[3],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "saved.up").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the service never started"
            time.sleep(0.05)
        proc.send_signal(15)  # to the entrypoint process alone, as Modal does
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop_group(proc, grace_s=0)
    assert marker.exists(), f"the service never got SIGTERM; entrypoint: {log.read_text()}"
    assert marker.read_text() == "checkpoint saved on SIGTERM"
    assert proc.returncode == 3 and "stopped on signal 15 (exit 0)" in log.read_text(), log.read_text()


CANCELLED = """
import signal, sys
from modal.exception import InputCancellation
from deploy import launch

def cancel(signum, frame):  # what Modal's container entrypoint installs for a sync function (SIGUSR1)
    raise InputCancellation("Input was cancelled by user")

signal.signal(signal.SIGUSR1, cancel)
try:
    launch.run([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)",
                sys.argv[1]])
except InputCancellation:
    print("cancelled", flush=True)
"""


def test_a_cancelled_call_ends_the_service_it_runs(tmp_path):
    """Cancelling a Modal call raises InputCancellation in the container's main thread, where ``launch.run``
    waits: the service (torchrun) must end with it. Before: it went on (training, renewing the lease)."""
    import os
    import signal
    import subprocess
    import time

    from host.processes import die_with_parent, stop_group

    pid_file, log = tmp_path / "service.pid", tmp_path / "entrypoint.log"
    with open(log, "w") as out:  # a file, not a pipe: a service left behind would hold a pipe open
        proc = subprocess.Popen([sys.executable, "-c", CANCELLED, str(pid_file)], cwd=Path(__file__).parents[3],
                                stdout=out, start_new_session=True, preexec_fn=die_with_parent)
    service = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the service never started"
            time.sleep(0.05)
        service = int(pid_file.read_text())
        proc.send_signal(signal.SIGUSR1)  # Modal cancels the input
        assert proc.wait(timeout=60) == 0 and "cancelled" in log.read_text()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{service}"):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{service}"), "the service outlived its cancelled call"
        service = None
    finally:
        stop_group(proc, grace_s=0)
        if service is not None:  # left behind (the failure above): its own group, started by this test
            with __import__("contextlib").suppress(ProcessLookupError):
                os.killpg(service, signal.SIGKILL)
