"""Child processes that tandem owns: free ports to give them, and ending them with all they started.

Whoever starts a service, a Redis, a sandbox or a test server starts it in its own
process group (``start_new_session=True``, with :func:`die_with_parent` for a
long-lived service) and ends it here, and nowhere else: :func:`stop_group` /
:func:`stop_groups` (threads, supervisors, tests) and :func:`stop_group_async`
(asyncio subprocesses: the sandboxes). Ending one means SIGTERM to the process
itself (it shuts its own children down in order: the rollout server stops vLLM's
engine core, Redis flushes its AOF), then, once it exited or after a grace period
(none: SIGKILL at once), SIGKILL to the whole group (stragglers), then to whatever
escaped the group but carries its owner's tag (:data:`OWNER_VARIABLE`: torchrun's
ranks have sessions of their own). Nothing is ever ended by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that the kernel will not hand out by itself.

    Ports come from below the ephemeral range: a port picked from inside it
    (``bind(0)``) can be taken by any other ``bind(0)`` before our server
    binds it, and vLLM's engine binds several while it starts, for tens of
    seconds, before uvicorn binds the service's port.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range is taken: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: the kernel SIGTERMs this child when its parent thread dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_groups(procs: Sequence[subprocess.Popen], grace_s: float = 30.0, *,
                owner: str | None = None, on_timeout=None) -> list[int]:
    """End processes started in their own process groups, and all they started; return their exit statuses.

    SIGTERM to each process still running (not its group: a group-wide SIGTERM would kill a child,
    such as vLLM's engine core, under the process that is shutting it down), a shared deadline of
    ``grace_s``, then SIGKILL to every group; ``grace_s=0`` sends no SIGTERM (a kill, as after a
    crash). ``on_timeout(proc)`` is called for each process still running at the deadline. With
    ``owner``, the processes that carry that tag are killed next (:func:`kill_owned`: what left the
    groups). Returns once the groups are empty too (at most 10 s more), so that what they held
    (a TMPDIR, a port) is free.
    """
    if grace_s > 0:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if on_timeout is not None:
                    on_timeout(proc)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    codes = [proc.wait(timeout=30) for proc in procs]
    if owner is not None:
        kill_owned(owner)
    deadline = time.monotonic() + 10
    while any(group_members(proc.pid) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return codes


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0, *, owner: str | None = None) -> int:
    """:func:`stop_groups` for one process."""
    return stop_groups([proc], grace_s, owner=owner)[0]


async def stop_group_async(proc: asyncio.subprocess.Process, grace_s: float = 0.0) -> int:
    """:func:`stop_group` for an asyncio subprocess: SIGTERM and up to ``grace_s`` to exit (0, the
    default: none), then SIGKILL to its group; returns its exit status.

    The group is killed only while the process is not yet reaped: its pid, the group's id, cannot
    have been given to another process then (the reward server starts a sandbox group per job,
    many at a time). A sandbox's agent ends its programs itself before it answers."""
    if proc.returncode is None and grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace_s)
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return await proc.wait()


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


OWNER_VARIABLE = "_TANDEM_OWNER"
"""Set by a supervisor in each child's environment (inherited by every descendant, whatever process
group or session it moves to: torchrun's ranks, vLLM's engine core), so that
:func:`owned_by` finds them all even after their parent died."""


def owner_tag(name: str) -> str:
    """The tag for the processes a new owner starts: ``name`` below the tag this process carries, if any.

    A stack or a learner started by a test session stays the session's (``owned_by(session)`` finds
    its processes too: the session kills them if it is killed itself) and keeps a tag of its own for
    its own cleanup."""
    inherited = os.environ.get(OWNER_VARIABLE)
    return f"{inherited}/{name}" if inherited else name


def owned_by(tag: str) -> list[int]:
    """Live processes whose environment carries ``OWNER_VARIABLE=tag`` (or a tag below it: ``tag/...``)."""
    return list(owners(tag))


def owners(tag: str) -> dict[int, str]:
    """:func:`owned_by` with each process's own tag (``tag`` or ``tag/...``): pid -> tag."""
    want = f"{OWNER_VARIABLE}={tag}".encode()
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state == "Z":
            continue
        found = next((v for v in env if v == want or v.startswith(want + b"/")), None)
        if found is not None:
            out[int(entry.name)] = found.split(b"=", 1)[1].decode(errors="replace")
    return out


def kill_owned(tag: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process :func:`owned_by` ``tag`` finds; wait until they are gone. Returns how many."""
    pids = owned_by(tag)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while owned_by(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)
