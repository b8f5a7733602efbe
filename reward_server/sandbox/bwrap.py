"""bubblewrap backend: a fresh set of namespaces per job, for machines without gVisor.

Each job is one ``bwrap`` process (≈0.01 s to start) running the agent in
``--oneshot`` mode:

- ``--unshare-all`` (user, pid, net, ipc, uts, cgroup namespaces: no network
  at all, loopback included), ``--die-with-parent``, ``--new-session``
  (no terminal injection), ``--clearenv``;
- a root of read-only binds of the Python runtime only
  (:mod:`reward_server.sandbox.runtime`), fresh ``/proc`` and ``/dev``,
  size-capped tmpfs on ``/tmp`` and ``/dev/shm``;
- ``--as-pid-1``: the agent is PID 1 of the new PID namespace, so the
  program cannot kill it (the kernel drops signals to a namespace's init
  that it has no handler for) and when it exits the kernel kills every
  process left in the namespace;
- bwrap itself is started under an unprivileged host uid, one per
  concurrent slot, because the kernel does not apply ``RLIMIT_NPROC`` to
  root: the process limit is then real, and one job's fork bomb cannot eat
  another's budget. Inside, the program sees uid 65534.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess

from reward_server.sandbox.base import (
    GUEST_MOUNT,
    Job,
    RunOutcome,
    Sandbox,
    SandboxError,
    parse_answer,
    read_answer,
    unanswered,
)
from reward_server.sandbox.runtime import discover

FIRST_HOST_UID = 61000


def bwrap_argv(bwrap: str, binds: tuple[tuple[str, str], ...], tmp_mb: int, command: list[str]) -> list[str]:
    argv = [
        bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--as-pid-1",
        "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
    ]
    for src, dst in binds:
        argv += ["--ro-bind", src, dst]
    argv += [
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
        "--size", str(16 << 20), "--tmpfs", "/dev/shm",
        "--remount-ro", "/",
        "--chdir", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        *command,
    ]
    return argv


def agent_command(python: str) -> list[str]:
    return [python, "-I", f"{GUEST_MOUNT}/agent.py", "--oneshot", "/tmp"]


def bwrap_works(bwrap: str = "bwrap", python: str = "/usr/bin/python3") -> str | None:
    """None if bubblewrap can run the sandboxed Python as an unprivileged uid here, else why not."""
    path = shutil.which(bwrap)
    if path is None:
        return f"{bwrap} not found"
    try:
        layout = discover(python)
    except (FileNotFoundError, subprocess.SubprocessError) as e:
        return f"no usable Python for the sandbox: {e}"
    argv = bwrap_argv(path, layout.binds, 16, [layout.python, "-I", "-c", "pass"])
    extra = {"user": FIRST_HOST_UID, "group": FIRST_HOST_UID, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False, **extra)
    except subprocess.TimeoutExpired:
        return "bwrap timed out"
    if done.returncode != 0:
        return f"bwrap failed: {done.stderr.decode(errors='replace')[-300:]}"
    return None


def _become(uid: int):
    def drop() -> None:  # in the child, before exec: the slot's unprivileged uid, no groups
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    return drop


class BwrapSandbox(Sandbox):
    name = "bwrap"

    def __init__(self, *, workers: int = 2, bwrap: str = "bwrap", python: str = "/usr/bin/python3",
                 tmp_mb: int = 256) -> None:
        layout = discover(python)
        self.python = layout.python
        self._argv = bwrap_argv(shutil.which(bwrap) or bwrap, layout.binds, tmp_mb, agent_command(layout.python))
        self._slots: asyncio.Queue[int] = asyncio.Queue()
        for i in range(workers):
            self._slots.put_nowait(FIRST_HOST_UID + i)
        self._procs: set[asyncio.subprocess.Process] = set()

    async def run(self, job: Job) -> list[RunOutcome]:
        uid = await self._slots.get()
        try:
            return await self._run(job, uid)
        finally:
            self._slots.put_nowait(uid)

    async def _run(self, job: Job, uid: int) -> list[RunOutcome]:
        # preexec_fn rather than user=/group=: uvloop's subprocess_exec does not take those.
        as_user = {"preexec_fn": _become(uid)} if os.geteuid() == 0 else {}
        proc = await asyncio.create_subprocess_exec(
            *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=1 << 20, **as_user,
        )
        self._procs.add(proc)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write(job.frame())
            await proc.stdin.drain()
            proc.stdin.close()
            body = await asyncio.wait_for(read_answer(proc.stdout), job.backstop_s())
            return parse_answer(body, job)
        except TimeoutError:
            return unanswered(job)
        except (BrokenPipeError, ConnectionResetError, SandboxError) as e:
            err = (await proc.stderr.read(4000)).decode(errors="replace") if proc.returncode is not None else ""
            raise SandboxError(f"bwrap sandbox failed: {e} {err}".strip()) from e
        finally:
            await self._end(proc)

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        # The agent exits after answering; the kill covers a wedged one (its namespace dies with it).
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        self._procs.discard(proc)

    async def close(self) -> None:
        for proc in list(self._procs):
            await self._end(proc)
