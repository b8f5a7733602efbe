"""Checkpoints, and the rule that a trained group is acknowledged only once a durable checkpoint holds it.

Who talks to whom: every rank saves its part of a checkpoint through ``learner.engine``
(``LearnerEngine.save``: DeepSpeed's shards, the rank's RNG state, the pointer file that commits
it); rank 0 adds the learner state and acknowledges the groups through the feeder's stream
(``learner.feeder``, ``broker.ledger``). The trainer (``learner.trainer``) decides when, and loads
the checkpoint at start-up (``LearnerEngine.load``).

The rule (steps 2, 4 and 5 of the trainer's loop):

- a trained group is *held* (:meth:`Checkpoints.hold`): its admission ticket is freed, its
  acknowledgement deferred;
- a checkpoint is due (:meth:`Checkpoints.due`) every ``learner.checkpoint_every`` steps or
  ``learner.checkpoint_every_s`` seconds and after the last step; the trainer also saves one when
  stopped on request (SIGTERM, not kill -9). It holds the step, ``v_learner``, each rank's RNG state,
  and the groups held since the last one (entry ids and their ledger details);
- once it is durable (on a Modal volume: committed by every node, since a retried learner sees
  committed files only), the held groups are acknowledged: each becomes *done* with its ledger
  ``trained`` entry;
- at a resume the groups the loaded checkpoint records as held are acknowledged before anything is
  taken over (:meth:`Checkpoints.ack_restored`; idempotent: a group already done gets no second
  ledger entry), so a group trained into the checkpointed weights is never trained again. Groups
  trained after the checkpoint were never acknowledged: they are taken over and trained again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from learner.crash import crash_point

if TYPE_CHECKING:
    from broker import Delivery, Stream
    from learner.engine import LearnerEngine
    from learner.feeder import Feeder
    from learner.status import Status
    from services.config import LearnerConfig
    from services.wire import TrajectoryGroup

log = logging.getLogger("tandem.learner")


def checkpoint_tag(step: int) -> str:
    """The name of the checkpoint saved after ``step`` steps (every rank saves under it)."""
    return f"step{step:08d}"


class Checkpoints:
    """One rank's checkpoints of a run in ``directory``; on rank 0 also the groups they hold."""

    def __init__(self, engine: LearnerEngine, directory: Path, cfg: LearnerConfig, volume: str | None,
                 status: Status) -> None:
        self.engine, self.directory, self.cfg, self.volume, self.status = engine, directory, cfg, volume, status
        self.held: list[tuple[Delivery, dict]] = []
        """Groups trained since the last checkpoint, with their ledger details (acknowledged after it)."""
        self.saved_step = 0
        """The step of the last checkpoint saved or resumed from."""
        self.saved_at = time.monotonic()

    def hold(self, step: int, basis: int, taken: list[tuple[Delivery, TrajectoryGroup]]) -> None:
        """``step`` trained ``taken`` (formed at ``v_learner = basis``): acknowledged after the next checkpoint."""
        self.held += [(d, {"step": step, "basis": basis, "version": g.policy_version}) for d, g in taken]

    def due(self, step: int) -> bool:
        """Whether ``step`` ends with a checkpoint: the last step, or every ``checkpoint_every`` steps or
        ``checkpoint_every_s`` seconds."""
        cfg = self.cfg
        return step >= cfg.steps or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0) \
            or (cfg.checkpoint_every_s > 0 and time.monotonic() - self.saved_at >= cfg.checkpoint_every_s)

    def restored(self, step: int) -> None:
        """The checkpoint resumed from (step 0: none) counts as the last one saved."""
        self.saved_step, self.saved_at = step, time.monotonic()

    async def ack_restored(self, stream: Stream, state: dict | None) -> None:
        """Acknowledge the groups the loaded checkpoint (its learner ``state``) records as held."""
        if state and state.get("unacked"):
            # trained into the checkpointed weights: done before anything is taken over (a group
            # already done, acknowledged after the checkpoint, gets no second count nor ledger entry)
            held = [_held(x) for x in state["unacked"]]
            await stream.ack([d for d, _ in held], counter="accepted", event="trained",
                             details=[x for _, x in held])

    async def save(self, step: int, version: int, feeder: Feeder) -> None:
        """Rank 0: save the checkpoint of ``step`` (collective) with the groups held since the last one,
        then acknowledge them: the checkpoint holds their update."""
        state = {
            "step": step, "version": version,
            "unacked": [[d.entry_id.decode(), d.envelope.group_id, x] for d, x in self.held],
        }
        self.status.state = "checkpointing"
        t0 = time.monotonic()
        self.engine.save(self.directory, checkpoint_tag(step), state)
        await asyncio.to_thread(self.commit)
        self.status.last_checkpoint_s = time.monotonic() - t0
        self.saved_step, self.saved_at = step, time.monotonic()
        crash_point("saved", step, self.directory)  # durable, its groups not acked yet
        await feeder.ack_trained([d for d, _ in self.held], [x for _, x in self.held])
        log.info("checkpoint at step %d in %.2f s; %d trained groups acknowledged",
                 step, self.status.last_checkpoint_s, len(self.held))
        self.held = []

    def save_shards(self, step: int) -> None:
        """Ranks > 0: this rank's part of the checkpoint of ``step`` (collective)."""
        self.engine.save(self.directory, checkpoint_tag(step), {})
        self.commit()

    def commit(self) -> None:
        """On a shared volume (Modal), make the checkpoint just saved durable before its groups are
        acknowledged: one commit per node (each node's ranks wrote their shards into that node's view),
        then a barrier, so rank 0 acknowledges only once every node's part is committed. A retried
        learner starts in a fresh container, which sees committed files only. Collective."""
        import torch

        from services import weightstore as store

        if not self.volume:
            return
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            store.commit_volume(self.volume)
        if self.engine.world > 1:
            torch.distributed.barrier()


def _held(record: list):
    """(Delivery handle, ledger details) of a group a checkpoint recorded as held."""
    from broker import Delivery, Envelope

    entry_id, gid, *rest = record  # checkpoints before the ledger held [entry_id, group_id]
    return Delivery(entry_id.encode(), Envelope(gid, -1, b""), 1), (rest[0] if rest else {})
