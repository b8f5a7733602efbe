"""The test session's reaper: once pytest is gone, however it ended, what the session started dies too.

``tests/conftest.py`` gives the session an owner tag (``host.processes.OWNER_VARIABLE``, inherited
by every process the session starts and by their descendants, whatever process group or session they
move to: torchrun's ranks, vLLM's engine core; stacks and learners nest their own tags below it) and
starts this process, ``python -m tests.reaper PID TAG``, in a session of its own: the signal that ends
pytest's process group (``timeout``, Ctrl-C) does not end it, and it needs no finaliser of pytest's,
so a SIGKILLed pytest is covered too. When process ``PID`` has exited, what is left gets ``GRACE_S``
to end by itself (the fixtures' direct children have a parent-death signal and shut their own
children down in order), then every process carrying the tag is SIGKILLed.
"""

from __future__ import annotations

import os
import select
import sys
import time

from host.processes import kill_owned, owned_by

GRACE_S = 10.0


def wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` (this process's parent) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already (or no pidfd, Linux < 5.3): watch for the reparenting instead
        while os.getppid() == pid:
            time.sleep(0.2)
        return
    try:
        select.select([fd], [], [])  # a pidfd is readable once its process has exited
    finally:
        os.close(fd)


def reap(tag: str, grace_s: float = GRACE_S) -> None:
    deadline = time.monotonic() + grace_s
    while owned_by(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(3):  # a supervisor killed mid-restart may have started one more
        if not kill_owned(tag):
            return


if __name__ == "__main__":
    parent, session_tag = int(sys.argv[1]), sys.argv[2]
    wait_for_exit(parent)
    reap(session_tag)
