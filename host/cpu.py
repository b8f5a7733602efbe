"""CPU-seconds of a set of processes, counted once each, read from ``/proc``.

A :class:`CpuMeter` follows one service's processes (the service, its vLLM engine core, torchrun's ranks,
its sandboxes) from sample to sample. A process's share is its own user and system time plus that of its
children it has reaped (``utime + stime + cutime + cstime``): a sandbox that ran and was waited for is in
its reward server's figure, once. A process that left the set without a parent in the set to reap it (the
service itself, restarted by its supervisor; an orphan) keeps its last reading, so the total never goes
back. What ran between the last sample and its end is not counted: sample about as often as that matters.

Figures are by process name (``/proc/PID/comm``: ``python``, ``VLLM::EngineCor``, ``runsc-sandbox``);
``docs/performance.md`` shows how a run's account reads.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def read_stat(pid: int) -> tuple[int, str, float] | None:
    """``(ppid, name, CPU-seconds with reaped children)`` of a live process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    # after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
    return int(fields[1]), name, sum(int(f) for f in fields[11:15]) / TICK


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` and every live process below them (one pass over ``/proc``)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            children[stat[0]].append(int(entry.name))
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


class CpuMeter:
    """CPU-seconds of the processes given to :meth:`sample`, by name, over every sample so far."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, str, float]] = {}
        self._gone: dict[str, float] = defaultdict(float)

    def sample(self, pids: Iterable[int]) -> dict[str, float]:
        """Read ``pids`` (the set's live processes now); return name -> CPU-seconds, the departed included."""
        now = {pid: stat for pid in set(pids) if (stat := read_stat(pid)) is not None}
        for pid, (ppid, name, seconds) in self._last.items():
            if pid not in now and ppid not in now:  # no parent of the set reaped it: keep its last reading
                self._gone[name] += seconds
        self._last = now
        out = defaultdict(float, self._gone)
        for _, name, seconds in now.values():
            out[name] += seconds
        return dict(out)
