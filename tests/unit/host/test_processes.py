"""host.processes: finding what a dead process started, whatever group or session it moved to, and
ending a process with everything it started."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from host.processes import (
    OWNER_VARIABLE,
    group_members,
    kill_owned,
    owned_by,
    stop_group,
    stop_group_async,
)

# a parent that starts a grandchild in a session of its own (as torchrun starts its ranks), prints its pid, waits
SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_an_orphan_in_another_session_is_found_by_its_owner_tag_and_killed():
    tag = f"test-{os.getpid()}-{time.monotonic_ns()}"
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], env={**os.environ, OWNER_VARIABLE: f"{tag}/learner"},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    orphan = int(parent.stdout.readline())
    try:
        assert set(owned_by(f"{tag}/learner")) == {parent.pid, orphan}
        assert set(owned_by(tag)) == {parent.pid, orphan}  # the stack's tag covers its children's
        assert owned_by(f"{tag}/rollout") == [] and owned_by(tag + "x") == []
        parent.kill()
        parent.wait()
        assert group_members(parent.pid) == []  # the orphan is not in the dead parent's group
        assert owned_by(f"{tag}/learner") == [orphan]
        assert kill_owned(f"{tag}/learner") == 1
        assert owned_by(tag) == []
    finally:
        for pid in (parent.pid, orphan):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


# a process that says when it gets SIGTERM (and then exits), with a child in its own group; prints that child's pid
TERM_SAYER = """
import signal, subprocess, sys, time
def term(*_):
    print("term", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _start(script: str, **kw) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    return proc, int(proc.stdout.readline())


def test_stop_group_asks_first_then_kills_the_group_and_what_left_it():
    tag = f"test-{os.getpid()}-{time.monotonic_ns()}"
    parent, orphan = _start(SCRIPT, env={**os.environ, OWNER_VARIABLE: tag})  # orphan: a session of its own
    sayer, child = _start(TERM_SAYER)  # child: in sayer's group, ignores SIGTERM
    try:
        assert stop_group(sayer, grace_s=10) == 0  # it exited on SIGTERM by itself
        assert sayer.stdout.read() == "term\n"
        assert group_members(sayer.pid) == []  # its child, which ignored SIGTERM, was killed with the group
        stop_group(parent, grace_s=10, owner=tag)
        assert owned_by(tag) == [] and group_members(parent.pid) == []
    finally:
        for pid in (parent.pid, orphan, sayer.pid, child):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_stop_group_without_grace_kills_at_once():
    sayer, child = _start(TERM_SAYER)
    try:
        assert stop_group(sayer, grace_s=0) == -9
        assert sayer.stdout.read() == ""  # no SIGTERM first: a kill, as after a crash
        assert group_members(sayer.pid) == []
    finally:
        for pid in (sayer.pid, child):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_stop_group_async_kills_the_group_of_a_running_process():
    async def main() -> tuple[int, int, int]:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", TERM_SAYER, stdout=asyncio.subprocess.PIPE,
                                                    start_new_session=True)
        child = int(await proc.stdout.readline())
        return proc.pid, child, await asyncio.wait_for(stop_group_async(proc), 10)  # its child holds stdout

    pid, child, code = asyncio.run(main())
    try:
        assert code == -9  # killed, not asked (it exits 0 on SIGTERM)
        deadline = time.monotonic() + 10
        while group_members(pid) and time.monotonic() < deadline:  # the kernel ends SIGKILLed processes soon after
            time.sleep(0.05)
        assert group_members(pid) == []  # its child too
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
