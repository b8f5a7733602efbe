"""gVisor backend: a warm pool of long-lived ``runsc run`` sandboxes, each running the agent.

Why not ``runsc do``: it shows the whole host file system read-only and
passes the host environment (tokens included), and it costs ~0.2-0.3 s per
call. Here each sandbox is an OCI bundle of our own:

- root: an empty read-only directory plus read-only binds of the Python
  runtime (:mod:`reward_server.sandbox.runtime`) and the guest code;
  ``/tmp`` is a private tmpfs; no network (``--network=none``); the only
  environment is the one in ``config.json``;
- the agent (``guest/agent.py --serve``) is PID 1 and root *in the sandbox*
  (gVisor's own kernel; on the host the sandbox runs as ``nobody``); it runs
  every job under a fresh uid in a fresh 0700 work dir and kills every
  process of that uid after each run, so no process, file or uid of one
  submission is alive when the next starts;
- programs are forked from a clean, pre-initialised Python (``guest/zygote.py``,
  forked before any job is read) instead of exec'ing a new interpreter:
  ~50 ms instead of ~170 ms per run under gVisor's ptrace platform;
- a sandbox is recycled after ``max_jobs`` jobs, and killed and replaced at
  once when it fails to answer in time or answers garbage;
- each run enters a new IPC namespace inside the sandbox (the agent holds
  ``CAP_SYS_ADMIN`` of gVisor's kernel for that; jobs hold no capability),
  so System V shared memory of one job is gone for the next;
- each sandbox has a host cgroup (:mod:`.cgroup`) capping memory (the
  largest admitted job, its /tmp and the sentry), host threads and CPU.
  It is the job's cgroup too: a sandbox runs one job at a time. runsc
  20221219 applies ``linux.resources`` only to a cgroup it creates itself,
  and deletes that one when the sandbox ends, before tandem could read its
  OOM count; so tandem creates the cgroup with the same limits and names it
  in ``linux.cgroupsPath`` (runsc joins an existing cgroup and leaves it
  alone). Without cgroups (not root), only the rlimits apply.

So the start cost is paid once per ``max_jobs`` jobs, not per test case.

Caveats measured with runsc 20221219 on the 2-core machine: ``--platform=kvm``
hangs in this VM (use the default ptrace platform); runsc creates missing
mount points inside the bundle's root directory, so they are created here first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

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
from reward_server.sandbox.pool import Pool
from reward_server.sandbox.runtime import discover

log = logging.getLogger("tandem.reward.gvisor")
_ids = itertools.count()
# Capabilities of gVisor's kernel, not the host's; CAP_SYS_ADMIN: a new IPC namespace per run.
AGENT_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_SYS_ADMIN"]
SENTRY_OVERHEAD_MB = 256  # gVisor's sentry and gofer, on top of the largest job and its /tmp
HOST_THREADS = 512  # the sentry's host threads (guest processes are not host processes)


def resources(limits: CgroupLimits) -> dict:
    """OCI ``linux.resources`` for ``limits``."""
    period = 100_000
    return {"memory": {"limit": limits.memory_bytes}, "pids": {"limit": limits.pids},
            "cpu": {"quota": max(1000, int(limits.cpus * period)), "period": period}}


def bundle_config(python: str, binds: tuple[tuple[str, str], ...], tmp_mb: int) -> dict:
    """The OCI runtime spec of one agent sandbox."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=711", f"size={tmp_mb}m"]},
    ] + [
        {"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro", "nosuid", "nodev"]}
        for src, dst in binds
    ]
    caps = {k: AGENT_CAPS for k in ("bounding", "effective", "permitted")}
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [python, "-I", f"{GUEST_MOUNT}/agent.py", "--serve"],
            "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
            "cwd": "/",
            "capabilities": caps,
            "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }


def make_bundle(directory: Path, python: str = "/usr/bin/python3", tmp_mb: int = 512) -> tuple[Path, str]:
    """Write a bundle (config.json + empty root with mount points); return it and the sandbox's python."""
    layout = discover(python)
    rootfs = directory / "rootfs"
    for _src, dst in layout.binds:
        target = rootfs / dst.lstrip("/")
        if os.path.isdir(_src):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
    for d in ("proc", "tmp", "dev"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    config = bundle_config(layout.python, layout.binds, tmp_mb)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory, layout.python


def cgroups_why_not(cgroups: bool = True) -> str | None:
    """None when each sandbox can get a host cgroup of its own, else why not."""
    if not cgroups:
        return "off"
    return cgroups_usable() if os.geteuid() == 0 else "not root"


def runsc_flags(cgroups: bool) -> list[str]:
    """runsc's global flags: no network, and no cgroups of its own where tandem makes none.

    In a container (docker compose) /sys/fs/cgroup is read-only, and runsc fails unless told
    to leave cgroups alone: "cannot set up cgroup for root: configuring cgroup: mkdir
    /sys/fs/cgroup/blkio/...: read-only file system"."""
    return ["--network=none"] + ([] if cgroups else ["--ignore-cgroups"])


def runsc_works(runsc: str = "runsc", *, cgroups: bool = True) -> str | None:
    """None if ``runsc`` can start a sandbox here (with cgroups when ``cgroups``), else why not."""
    path = shutil.which(runsc)
    if path is None:
        return f"{runsc} not found"
    try:
        done = subprocess.run([path, *runsc_flags(cgroups), "do", "true"], capture_output=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "runsc do timed out"
    if done.returncode != 0:
        return f"runsc do failed: {done.stderr.decode(errors='replace')[-300:]}"
    return None


class _Container:
    """One running sandbox with its agent; serves one job at a time."""

    def __init__(self, runsc: str, state: Path, bundle: Path, limits: CgroupLimits | None = None) -> None:
        self.runsc, self.state = runsc, state
        self.id = f"tandem-{os.getpid()}-{next(_ids)}"
        self.proc: asyncio.subprocess.Process | None = None
        self.jobs = 0
        self.cgroup: Cgroup | None = None
        self.limits = limits
        self.bundle = bundle
        if limits is not None:  # a bundle of its own: the shared root, this sandbox's cgroup
            made = Cgroup.create(Cgroup.unique_name("tandem-gvisor"), limits)
            if isinstance(made, str):
                raise SandboxError(made)
            self.cgroup = made
            config = json.loads((bundle / "config.json").read_text())
            config["root"]["path"] = str(bundle / "rootfs")
            config["linux"]["cgroupsPath"] = made.path
            config["linux"]["resources"] = resources(limits)
            self.bundle = state / f"bundle-{self.id}"
            self.bundle.mkdir()
            (self.bundle / "config.json").write_text(json.dumps(config, indent=1))

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            self.runsc, "--root", str(self.state), *runsc_flags(self.limits is not None), "run", "--bundle", str(self.bundle),
            self.id,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True, limit=1 << 20,
        )

    async def run(self, job: Job) -> list[RunOutcome]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.jobs += 1
        try:
            self.proc.stdin.write(job.frame())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise SandboxError(f"sandbox {self.id} is gone: {e}") from e
        try:
            return await read_verdicts(self.proc.stdout, job)
        except SandboxEnded as e:
            with contextlib.suppress(TimeoutError):  # let runsc finish so the OOM count is final
                await asyncio.wait_for(self.proc.wait(), 2.0)
            raise SandboxEnded(str(e), out_of_memory=self.cgroup is not None and self.cgroup.oom_kills() > 0) from e

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        """End the sandbox and everything in it; safe to call twice.

        ``runsc delete --force`` on a running sandbox takes ~5 s here (it waits for a
        stop that times out), so: close the agent's stdin (it exits at once when
        healthy), else ``runsc kill ID KILL``, and only then the heavy hammer."""
        if self.proc is None:
            await self.remove_cgroup()
            return
        if self.proc.returncode is None and self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 1.0)
        if self.proc.returncode is None:
            await self._runsc("kill", self.id, "KILL", timeout_s=3.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 3.0)
        if self.proc.returncode is None:
            # A wedged sandbox does not answer runsc's control calls: kill its host processes.
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await self.proc.wait()
            await self._runsc("delete", "--force", self.id)
        await self.remove_cgroup()

    async def remove_cgroup(self) -> None:
        if self.cgroup is not None:
            cgroup, self.cgroup = self.cgroup, None
            await asyncio.to_thread(cgroup.remove)  # it may wait for the last killed processes
        if self.bundle.name.startswith("bundle-"):
            shutil.rmtree(self.bundle, ignore_errors=True)

    async def _runsc(self, *args: str, timeout_s: float = 10.0) -> None:
        proc = await asyncio.create_subprocess_exec(
            self.runsc, "--root", str(self.state), *args,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            proc.kill()  # runsc's control call is stuck on the sandbox: give up on it
            await proc.wait()


def descendants(pid: int) -> list[int]:
    """Host pids below ``pid`` (runsc's gofer and sandbox processes), deepest first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found[::-1]


class GVisorSandbox(Sandbox):
    name = "gvisor"

    def __init__(self, *, workers: int = 2, max_jobs: int = 500, runsc: str = "runsc",
                 python: str = "/usr/bin/python3", tmp_mb: int = 512, max_memory_mb: int = 2048,
                 cpus: float = 1.0, cgroups: bool = True) -> None:
        self.runsc = shutil.which(runsc) or runsc
        self.workers, self.max_jobs, self.tmp_mb = workers, max_jobs, tmp_mb
        self._python_host = python
        self._dir = Path(tempfile.mkdtemp(prefix="tandem-gvisor-"))
        self._state = self._dir / "state"
        self._state.mkdir()
        self._bundle, self.python = make_bundle(self._dir / "bundle", python, tmp_mb)
        self._containers: set[_Container] = set()
        why = cgroups_why_not(cgroups)
        self.limits = None if why else CgroupLimits((max_memory_mb + tmp_mb + SENTRY_OVERHEAD_MB) << 20,
                                                    HOST_THREADS, cpus)
        if why:
            log.warning("gVisor: no cgroup per sandbox (%s); only rlimits inside the sandbox cap a job", why)
        self.pool: Pool[_Container] = Pool(self._spawn, self._destroy, size=workers, max_uses=max_jobs)

    async def _spawn(self) -> _Container:
        container = _Container(self.runsc, self._state, self._bundle, self.limits)
        self._containers.add(container)  # before start: a cancelled spawn is still found by close()
        await container.start()
        return container

    async def _destroy(self, container: _Container) -> None:
        await container.kill()
        self._containers.discard(container)

    async def start(self) -> None:
        await self.pool.start()

    async def run(self, job: Job) -> list[RunOutcome]:
        return await run_blaming(self._attempt, job, self.python)

    async def _attempt(self, job: Job) -> list[RunOutcome]:
        async with self.pool.borrow() as loan:
            container = loan.item
            try:
                return await asyncio.wait_for(container.run(job), job.backstop_s())
            except TimeoutError:
                loan.discard()
                log.warning("sandbox %s did not answer in %.0f s; killed", container.id, job.backstop_s())
                return unanswered(job)
            except SandboxError:
                loan.discard()  # SandboxEnded too: the sandbox is dead, the next try gets another
                raise

    async def close(self) -> None:
        await self.pool.close()
        await asyncio.gather(*(c.kill() for c in list(self._containers)))  # leased or half-started ones
        self._containers.clear()
        shutil.rmtree(self._dir, ignore_errors=True)
