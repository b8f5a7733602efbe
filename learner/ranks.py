"""What rank 0 tells the other ranks of a multi-rank learner: one :class:`RankCommand` per broadcast.

Rank 0 alone talks to Redis; it decides each step and sends the command
before its own part, so every rank runs the same collectives in the same
order (``learner.trainer`` is the loop; this module is its protocol)::

    rank 0                                         ranks > 0
    send(RankCommand(step=s, rows, publish, ckpt)) cmd = receive()
    train_step(rows[0])                            train_step(cmd.rows[rank])
    publish: gather, write, register               publish: gather (rank 0 writes)
    checkpoint: save (with the learner state)      checkpoint: save (its shards, its RNG)
    ...
    send(RankCommand(step=s, stop=True))           return

A command is carried out in the order its fields are declared: train on
``rows``, then publish, then checkpoint, then stop. The other commands are
the same type with fewer fields set: the publish of a resume (no rows), the
checkpoint of a run stopped on request (no rows), and the final stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learner.batch import TrainSeq


@dataclass(frozen=True)
class RankCommand:
    """One step of the protocol, from rank 0 to every other rank."""

    step: int
    """Optimizer steps taken once this command is carried out; names the checkpoint it saves."""
    rows: list[list[TrainSeq]] | None = None
    """Every rank's rows of one optimizer step (``rows[rank]``, from ``learner.batch.split_ranks``);
    None: no training in this command."""
    publish: bool = False
    """Take part in gathering the full weights (collective; rank 0 writes and registers them)."""
    checkpoint: bool = False
    """Save a checkpoint tagged with ``step`` (collective)."""
    stop: bool = False
    """The run is over for this process: leave the loop (nothing else may be set)."""
    failed: bool = False
    """With ``stop``: rank 0 failed, so the others fail too."""

    def __post_init__(self) -> None:
        if self.failed and not self.stop:
            raise ValueError("failed is only meaningful with stop")
        if self.stop and (self.rows is not None or self.publish or self.checkpoint):
            raise ValueError("a stop command does nothing else")


class RankChannel:
    """Rank 0's end: sends each command to the other ranks (nothing to send with one rank)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.stopped = False
        """True once a stop was sent: the other ranks no longer listen."""

    def send(self, cmd: RankCommand) -> None:
        if self.stopped:
            raise RuntimeError(f"the other ranks were told to stop already; cannot send {cmd}")
        if self.world > 1:
            import torch

            from learner.distributed import CollectiveTimeout, collective

            try:
                with collective("broadcast of rank 0's step command"):
                    torch.distributed.broadcast_object_list([cmd], src=0)
            except CollectiveTimeout:
                self.stopped = True  # the other ranks are gone: nothing more can be sent
                raise
        self.stopped = cmd.stop


def receive() -> RankCommand:
    """Ranks > 0: wait for rank 0's next command."""
    import torch

    from learner.distributed import collective

    box: list[RankCommand | None] = [None]
    with collective("broadcast of rank 0's step command"):
        torch.distributed.broadcast_object_list(box, src=0)
    cmd = box[0]
    if not isinstance(cmd, RankCommand):
        raise TypeError(f"rank 0 sent {type(cmd).__name__}, not a RankCommand")
    return cmd
