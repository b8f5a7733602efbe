"""Setting up a learner rank's distributed side: DeepSpeed imported ahead, the process group, named collectives.

Who calls it: ``learner.service`` calls :func:`preload` while it waits for its first run;
``learner.engine.LearnerEngine`` calls :func:`init_distributed` when it is built and wraps its
collectives in :func:`collective`; ``learner.ranks`` does the same for the commands rank 0
broadcasts to the other ranks.

Process group: ``deepspeed.init_distributed`` with gloo on CPU (``DS_ACCELERATOR=cpu``), NCCL on
GPUs; rank/world from the launcher's environment (``torchrun`` / ``deepspeed``), or a single rank
when none is set. Its timeout is ``watchdog.collective_s`` (``[watchdog]``, ``services.watchdog``),
so a collective whose peer rank stopped answering fails instead of waiting forever;
:func:`collective` turns that failure into :class:`CollectiveTimeout`, naming the collective it was
in (the trainer fails the run with it).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch

from services import watchdog

log = logging.getLogger("tandem.learner")


class CollectiveTimeout(RuntimeError):
    """A collective between learner ranks waited past ``watchdog.collective_s``; the message names it."""


_collective_s: float | None = None
"""The process group's timeout, as :func:`init_distributed` set it (process-wide, like the group)."""


@contextmanager
def collective(name: str, *, step: int | None = None,
               incidents: watchdog.SyncIncidentLog | None = None) -> Iterator[None]:
    """Name the collective(s) inside: one whose peer rank stopped answering fails, once the
    process group's timeout (``watchdog.collective_s``) expires, with :class:`CollectiveTimeout`
    naming it (logged with this rank's stack, recorded in ``incidents``)."""
    t0 = time.monotonic()
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as e:  # gloo and NCCL timeouts arrive as torch.distributed.DistError
        waited, limit = time.monotonic() - t0, _collective_s
        text = str(e).lower()
        if "timed out" not in text and "timeout" not in text and (limit is None or waited < 0.9 * limit):
            raise
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        inc = watchdog.incident(
            f"learner rank {rank} of {world}" + (f", step {step}" if step is not None else ""),
            f"the collective {name} (a peer rank stopped answering)", waited_s=waited,
            limit_s=limit or waited, field="watchdog.collective_s", action="the run fails",
            source=f"learner:rank{rank}", stack=watchdog.thread_stack(threading.get_ident()),
        )
        log.error("%s\n%s", watchdog.message(inc), inc.stack)
        if incidents is not None:
            try:
                incidents.append(inc)
            except Exception as e2:  # noqa: BLE001  the error below matters more than the record
                log.error("could not record the incident: %r", e2)
        raise CollectiveTimeout(f"{watchdog.message(inc)}: {e}") from e


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed for DeepSpeed (idempotent); return (rank, world).

    ``timeout_s``: the process group's collective timeout (``watchdog.collective_s``; DeepSpeed's
    default, 600 s, otherwise)."""
    global _collective_s
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        # single process without a launcher: a one-rank group on a free local port
        from host.processes import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not torch.distributed.is_initialized():
        backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
        kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        _without_shm_op()
        deepspeed.init_distributed(dist_backend=backend, **kw)
        _collective_s = timeout_s
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def preload() -> None:
    """Import what building a ``learner.engine.LearnerEngine`` imports (10-23 s measured on two busy cores),
    so that a learner waiting for its first run has done it before the run arrives.
    ``torch._inductor``: ``deepspeed.initialize`` checks the optimizer against a list that imports
    DeepSpeed's Muon optimizer, whose ``torch.compile`` decorators import it (3.8 s of those)."""
    for module in ("deepspeed", "deepspeed.runtime.engine", "transformers.modeling_utils", "torch._inductor.compile_fx"):
        importlib.import_module(module)


def _without_shm_op() -> None:
    """Keep DeepSpeed's communication backend from building its shared-memory all-reduce op.

    On CPU, DeepSpeed's ``TorchBackend`` JIT-compiles the C++ op ``deepspeed_shm_comm`` whenever it
    starts, even on one rank (minutes on two cores: docs/reliability.md, "Faults"), again
    whenever the shared build cache (``~/.cache/torch_extensions``) was last built with other flags.
    The op serves only ``inference_all_reduce`` (DeepSpeed's tensor-parallel inference layers);
    training never calls it: ZeRO's collectives go through ``torch.distributed`` (gloo), on any
    number of ranks."""
    # by name: ``import deepspeed.comm.torch`` binds deepspeed.comm's attribute ``torch``, the torch package
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
