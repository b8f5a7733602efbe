"""A vLLM plugin (entry point ``vllm.general_plugins``): how long vLLM's processes spin while they wait, and where they run.

vLLM loads every general plugin in each of its processes: the engine core and each worker (on the
CPU backend the worker is always a process of its own). The two hand each step's request and its
result to each other through a shared-memory queue, and a reader that read less than a second ago
does not sleep to wait for the next message: it spins on ``sched_yield`` (``SpinCondition.wait``,
``busy_loop_s = 1``). While the worker computes, the engine core spins; while the engine core
schedules, the worker spins. On a GPU machine that costs an idle CPU core; where the rollout
server shares a machine's cores with the learner it takes them from the learner's step:
``bench/cpu_profile.py`` found a third of the rollout server's CPU in that loop
(docs/performance.md, "Where the CPU goes").

:func:`register` caps that spin at ``_TANDEM_VLLM_SPIN_S`` seconds (the rollout server sets it from
``TANDEM_ROLLOUT_VLLM_SPIN_S``, ``rollout_server.settings``); past it the reader blocks on the queue's
notification socket, as vLLM's does after its second. Unset (any other vLLM in this environment),
the plugin changes nothing.

It also keeps the engine core on its worker's cores. vLLM's CPU worker binds its OpenMP threads to the
cores ``VLLM_CPU_OMP_THREADS_BIND`` names (the stack gives the rollout server half of a machine's
cores, ``deploy.stack.cpu_split``), but the engine core floats: while the worker computed a step, the
engine core's wait ran on the learner's cores. Given ``_TANDEM_VLLM_CORES`` (the rollout server sets
it from ``VLLM_CPU_OMP_THREADS_BIND``), each process vLLM starts runs on those cores from its start;
the rollout server's own process, which decodes vLLM's outputs and scores, still floats. The example,
tandem alone, back to back (docs/performance.md, "2026-12-05: vLLM's engine core on its worker's core"): 82.7-89.1 s
of training steps and 7.9-8.7 CPU-ms per trained sample pinned, against 96.0-104.3 s and 9.5-10.2.
"""

from __future__ import annotations

import multiprocessing
import os
import re

SPIN_VARIABLE = "_TANDEM_VLLM_SPIN_S"
"""Set in the rollout server's own environment, which every process it starts inherits: underscored, as
``_TANDEM_OWNER``, so that it is no ``TANDEM_*`` setting, which the services' settings check would refuse."""


CORES_VARIABLE = "_TANDEM_VLLM_CORES"
"""The cores (``0,1``) the processes vLLM starts run on; underscored as :data:`SPIN_VARIABLE` is."""


def bound_cores(bind: str | None) -> list[int] | None:
    """The cores of a ``VLLM_CPU_OMP_THREADS_BIND`` of one rank (``0``, ``0-3``, ``0,2-3``); None for
    vLLM's ``auto`` and ``nobind``, one list per tensor-parallel rank (``0-1|2-3``) or nothing."""
    if not bind or not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", bind):
        return None
    cores: set[int] = set()
    for part in bind.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def register() -> None:
    cores = os.environ.get(CORES_VARIABLE)
    if cores and multiprocessing.parent_process() is not None:  # vLLM's engine core or worker, not the server
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    raw = os.environ.get(SPIN_VARIABLE)
    if not raw:
        return
    spin_s = float(raw)
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition, "_tandem_spin_s", None) is not None:
        condition._tandem_spin_s = spin_s
        return
    wait = condition.wait

    def capped_wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, condition._tandem_spin_s)
        return wait(self, timeout_ms)

    condition._tandem_spin_s = spin_s
    condition.wait = capped_wait
