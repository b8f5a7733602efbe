"""A vLLM plugin (entry point ``vllm.general_plugins``): how long vLLM's processes spin while they wait.

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
"""

from __future__ import annotations

import os

SPIN_VARIABLE = "_TANDEM_VLLM_SPIN_S"
"""Set in the rollout server's own environment, which every process it starts inherits: underscored, as
``_TANDEM_OWNER``, so that it is no ``TANDEM_*`` setting, which the services' settings check would refuse."""


def register() -> None:
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
