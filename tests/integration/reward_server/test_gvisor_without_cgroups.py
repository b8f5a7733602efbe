"""gVisor where tandem makes no cgroups (a container's read-only /sys/fs/cgroup: docker compose).

runsc would make a cgroup of its own for every sandbox and fail where it cannot ("cannot set up
cgroup for root: ... read-only file system"), so without tandem's cgroups runsc is told to leave
them alone (``--ignore-cgroups``). Here, on the host, the sandbox still runs programs that way and
no runsc process of it asks for cgroups; the compose test (tests/compose/test_compose_code.py)
runs the same code in the container where it matters.
"""

from __future__ import annotations

import pytest

from reward_server.sandbox.base import Job, python_run
from reward_server.sandbox.gvisor import GVisorSandbox, descendants, runsc_works
from services.reward_specs import Limits

LIMITS = Limits(wall_s=5.0, cpu_s=5.0, memory_mb=256, processes=16)


def test_runsc_starts_without_cgroups():
    assert runsc_works(cgroups=False) is None


async def test_a_program_runs_in_a_sandbox_without_cgroups():
    sandbox = GVisorSandbox(workers=1, cgroups=False)
    try:
        await sandbox.start()
        assert sandbox.limits is None
        (outcome,) = await sandbox.run(Job(files={"main.py": "print(6 * 7)"}, runs=[python_run(sandbox.python)],
                                           limits=LIMITS))
        assert (outcome.status, outcome.stdout) == ("ok", "42\n"), outcome
        [container] = sandbox._containers
        with open(f"/proc/{container.proc.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"--ignore-cgroups" in argv and b"run" in argv, argv
        assert descendants(container.proc.pid)  # runsc's gofer and sandbox are up
    finally:
        await sandbox.close()


@pytest.mark.parametrize("cgroups", [True, False])
def test_the_flag_follows_the_cgroups(cgroups):
    from reward_server.sandbox.gvisor import runsc_flags

    assert ("--ignore-cgroups" in runsc_flags(cgroups)) is not cgroups
    assert "--network=none" in runsc_flags(cgroups)
