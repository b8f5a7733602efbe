"""Host cgroups that cap a job's memory, processes and CPU as a whole (not per process).

rlimits bound each process (``RLIMIT_AS`` of one process, ``RLIMIT_NPROC``
of one uid); a job of 32 processes could still hold 32 x ``memory_mb``.
A cgroup bounds all of them together:

- bubblewrap: one cgroup per job, made before ``bwrap`` starts and joined by
  it between fork and exec; ``memory = memory_mb + BWRAP_OVERHEAD_MB``
  (the agent), ``pids = processes + 4`` (bwrap, the agent), CPU quota
  ``cpus`` cores. Removed (its processes killed first) after the job.
- gVisor: one cgroup per warm sandbox, named in the OCI spec's
  ``linux.cgroupsPath``. A sandbox runs one job at a time, so this is the
  job's cgroup too; memory is sized for the largest job the server admits
  (``max_memory_mb``) plus the sentry's own use. Processes inside gVisor are
  not host processes: their count is capped by ``RLIMIT_NPROC`` of the
  job's unique uid inside the sandbox, and ``pids`` here caps the sentry's
  host threads.

Both layouts are supported: cgroup v2 (``/sys/fs/cgroup/cgroup.controllers``
with memory, pids and cpu enabled) and v1 (one hierarchy per controller,
what this project's CPU machine has). :func:`cgroups_usable` says whether
this host lets tandem create them (root, or a delegated subtree); without
them the rlimits are all there is, and the server logs it.

The OOM count (:meth:`Cgroup.oom_kills`) tells a job that ran out of memory
(the kernel killed something in its cgroup) from other sandbox deaths.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_ids = itertools.count()


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    pids: int
    cpus: float


def version() -> int | None:
    """2 for a unified hierarchy with our controllers, 1 for v1 hierarchies, None if neither."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists():
        return 2 if set(CONTROLLERS) <= set(controllers.read_text().split()) else None
    return 1 if all((ROOT / c / "cgroup.procs").exists() for c in CONTROLLERS) else None


def cgroups_usable() -> str | None:
    """None if tandem can create limited cgroups here, else why not."""
    v = version()
    if v is None:
        return "no cgroup v2 hierarchy with memory, pids and cpu, nor v1 hierarchies of them"
    remove_stale()
    probe = Cgroup.create(Cgroup.unique_name("tandem-probe"), CgroupLimits(64 << 20, 16, 1.0))
    if isinstance(probe, str):
        return probe
    probe.remove()
    return None


def remove_stale() -> None:
    """Delete tandem's cgroups whose server process is gone (it was killed before it could clean up)."""
    v = version()
    tops = [ROOT] if v == 2 else [ROOT / c for c in CONTROLLERS]
    for top in tops:
        for d in top.glob("tandem-*-*-*"):
            owner = d.name.rsplit("-", 2)[1]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                Cgroup(d.name, [d], 2).remove()


class Cgroup:
    """One cgroup (in each v1 hierarchy, or one v2 directory) owned by tandem."""

    def __init__(self, name: str, dirs: list[Path], v: int) -> None:
        self.name, self.dirs, self.version = name, dirs, v

    @classmethod
    def create(cls, name: str, limits: CgroupLimits) -> Cgroup | str:
        """Make the cgroup with ``limits``; on failure remove what was made and return why."""
        v = version()
        if v is None:
            return "no usable cgroup hierarchy"
        dirs = [ROOT / name] if v == 2 else [ROOT / c / name for c in CONTROLLERS]
        group = cls(name, [], v)
        try:
            for d in dirs:
                d.mkdir(parents=True)
                group.dirs.append(d)
            quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
            if v == 2:
                group._write("memory.max", limits.memory_bytes)
                group._write("memory.swap.max", 0, optional=True)
                group._write("pids.max", limits.pids)
                group._write("cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                group._write("memory.limit_in_bytes", limits.memory_bytes)
                group._write("memory.memsw.limit_in_bytes", limits.memory_bytes, optional=True)
                group._write("pids.max", limits.pids)
                group._write("cpu.cfs_period_us", CPU_PERIOD_US)
                group._write("cpu.cfs_quota_us", quota)
        except OSError as e:
            group.remove()
            return f"cannot create cgroup {name}: {e}"
        return group

    @classmethod
    def unique_name(cls, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(_ids)}"

    def _file(self, name: str) -> Path:
        if self.version == 2:
            return self.dirs[0] / name
        controller = name.split(".", 1)[0]  # v1: memory.* lives in the memory hierarchy, and so on
        return next(d for d in self.dirs if d.parent.name == controller) / name

    def _write(self, name: str, value: object, optional: bool = False) -> None:
        try:
            self._file(name).write_text(str(value))
        except OSError:
            if not optional:
                raise

    @property
    def path(self) -> str:
        """The cgroup's path below each hierarchy's root (OCI ``linux.cgroupsPath``)."""
        return "/" + self.name

    def join(self) -> None:
        """Move the calling process here (in a child between fork and exec)."""
        pid = str(os.getpid())
        for d in self.dirs:
            (d / "cgroup.procs").write_text(pid)

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this cgroup."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in self._file(name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(found)

    def remove(self) -> None:
        """Kill whatever is left in the cgroup, then delete it (each hierarchy's directory)."""
        for _ in range(100):
            left = self.pids()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last killed processes are reaped
                    time.sleep(0.01)
        self.dirs = []
