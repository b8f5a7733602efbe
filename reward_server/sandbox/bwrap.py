"""bubblewrap backend: a fresh set of namespaces per job, for machines without gVisor.

Each job is one ``bwrap`` process (≈0.01 s to start) running the agent in
``--oneshot`` mode:

- ``--unshare-all`` (user, pid, net, ipc, uts, cgroup namespaces: no network
  at all, loopback included, and a fresh System V IPC namespace per job),
  ``--die-with-parent``, ``--new-session`` (no terminal injection),
  ``--clearenv``;
- ``--disable-userns`` (bubblewrap >= 0.8): no user namespace can be made
  inside, and the seccomp filter of :mod:`.seccomp` (``--seccomp FD``) refuses
  new namespaces, ptrace, keyctl, bpf, mount and the rest of its list;
- a root of read-only binds of the Python runtime only
  (:mod:`reward_server.sandbox.runtime`), fresh ``/proc`` and ``/dev``,
  size-capped tmpfs on ``/tmp`` and ``/dev/shm``;
- ``--as-pid-1``: the agent is PID 1 of the new PID namespace, so the
  program cannot kill it (the kernel drops signals to a namespace's init
  that it has no handler for) and when it exits the kernel kills every
  process left in the namespace;
- bwrap itself is started under an unprivileged host uid, a different one
  for every job (a rolling range of ``HOST_UIDS``, far more than jobs run
  at once), because the kernel does not apply ``RLIMIT_NPROC`` to root: the
  process limit is then real, and one job's fork bomb cannot eat another's
  budget. Inside, the program sees uid 65534;
- when this host lets tandem make cgroups (:mod:`.cgroup`), bwrap joins a
  fresh one per job before it execs: the job's memory, processes and CPU
  are capped as a whole, and the OOM count tells a job that ran out of
  memory from one that ended its sandbox otherwise (:mod:`.blame`).
  Without cgroups only the agent's per-process rlimits apply.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import subprocess

from host.processes import stop_group_async
from reward_server.sandbox.base import (
    GUEST_MOUNT,
    Job,
    RunOutcome,
    Sandbox,
    SandboxError,
    unanswered,
)
from reward_server.sandbox.blame import SandboxEnded, read_verdicts, run_blaming
from reward_server.sandbox.cgroup import Cgroup, CgroupLimits, cgroups_usable
from reward_server.sandbox.runtime import discover
from reward_server.sandbox.seccomp import filter_bytes

log = logging.getLogger("tandem.reward.bwrap")
FIRST_HOST_UID = 61000
HOST_UIDS = 4000
BWRAP_OVERHEAD_MB = 64  # the agent's own memory, on top of the job's memory_mb
BWRAP_EXTRA_PIDS = 4  # bwrap and the agent, on top of the job's processes


def seccomp_fd() -> int:
    """A fresh descriptor holding the compiled filter, for one ``bwrap --seccomp FD`` (it reads it to the end)."""
    fd = os.memfd_create("tandem-seccomp", 0)
    os.write(fd, filter_bytes())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def bwrap_argv(bwrap: str, binds: tuple[tuple[str, str], ...], tmp_mb: int, command: list[str],
               seccomp: int) -> list[str]:
    argv = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--clearenv", "--as-pid-1", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
        "--seccomp", str(seccomp),
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
    try:
        fd = seccomp_fd()
    except RuntimeError as e:
        return str(e)
    argv = bwrap_argv(path, layout.binds, 16, [layout.python, "-I", "-c", "pass"], fd)
    extra = {"user": FIRST_HOST_UID, "group": FIRST_HOST_UID, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False, pass_fds=(fd,), **extra)
    except subprocess.TimeoutExpired:
        return "bwrap timed out"
    finally:
        os.close(fd)
    if done.returncode != 0:
        return f"bwrap failed: {done.stderr.decode(errors='replace')[-300:]}"
    return None


def _enter(uid: int, cgroup: Cgroup | None):
    def enter() -> None:  # in the child, before exec: the job's cgroup, then its unprivileged uid, no groups
        if cgroup is not None:
            cgroup.join()
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    return enter


class BwrapSandbox(Sandbox):
    name = "bwrap"

    def __init__(self, *, workers: int = 2, bwrap: str = "bwrap", python: str = "/usr/bin/python3",
                 tmp_mb: int = 256, cpus: float = 1.0, cgroups: bool = True) -> None:
        layout = discover(python)
        self.python = layout.python
        self._bwrap, self._binds, self._tmp_mb = shutil.which(bwrap) or bwrap, layout.binds, tmp_mb
        self._command = agent_command(layout.python)
        self._slots = asyncio.Semaphore(workers)
        self._uids = itertools.count()
        self._procs: set[asyncio.subprocess.Process] = set()
        self.cpus = cpus
        why = cgroups_usable() if cgroups and os.geteuid() == 0 else "off" if not cgroups else "not root"
        self.cgroups = why is None
        if not self.cgroups:
            log.warning("bubblewrap: no per-job cgroup (%s); only per-process rlimits cap a job", why)

    async def run(self, job: Job) -> list[RunOutcome]:
        async with self._slots:
            return await run_blaming(self._attempt, job, self.python)

    async def _attempt(self, job: Job) -> list[RunOutcome]:
        uid = FIRST_HOST_UID + next(self._uids) % HOST_UIDS
        cgroup = None
        if self.cgroups:
            made = Cgroup.create(Cgroup.unique_name("tandem-bwrap"), CgroupLimits(
                (job.limits.memory_mb + BWRAP_OVERHEAD_MB) << 20, job.limits.processes + BWRAP_EXTRA_PIDS, self.cpus))
            if isinstance(made, str):
                raise SandboxError(made)
            cgroup = made
        try:
            return await self._run(job, uid, cgroup)
        finally:
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)  # it may wait for the last killed processes

    async def _run(self, job: Job, uid: int, cgroup: Cgroup | None) -> list[RunOutcome]:
        # preexec_fn rather than user=/group=: uvloop's subprocess_exec does not take those.
        as_user = {"preexec_fn": _enter(uid, cgroup)} if os.geteuid() == 0 else {}
        fd = seccomp_fd()
        try:
            proc = await asyncio.create_subprocess_exec(
                *bwrap_argv(self._bwrap, self._binds, self._tmp_mb, self._command, fd),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, limit=1 << 20, pass_fds=(fd,), **as_user,
            )
        finally:
            os.close(fd)
        self._procs.add(proc)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write(job.frame())
            await proc.stdin.drain()
            proc.stdin.close()
            return await asyncio.wait_for(read_verdicts(proc.stdout, job), job.backstop_s())
        except TimeoutError:
            return unanswered(job)
        except SandboxEnded as e:
            raise SandboxEnded(str(e), out_of_memory=cgroup is not None and cgroup.oom_kills() > 0) from e
        except (BrokenPipeError, ConnectionResetError, SandboxError) as e:
            await self._end(proc)
            err = (await proc.stderr.read(4000)).decode(errors="replace")
            raise SandboxError(f"bwrap sandbox failed: {e} {err}".strip()) from e
        finally:
            await self._end(proc)

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        # The agent exits after answering; the kill covers a wedged one (its namespace dies with it).
        await stop_group_async(proc)
        self._procs.discard(proc)

    async def close(self) -> None:
        for proc in list(self._procs):
            await self._end(proc)
