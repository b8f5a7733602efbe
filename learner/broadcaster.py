"""Rank 0's half of ``publish.transport = "broadcast"``: announce a version's group and stream it.

Called by the trainer's publish (``learner.trainer``) between the gather and the file write: the
rollout servers that :meth:`joined <broker.broadcast.BroadcastBoard.join>` are seated, the group is
announced through Redis (``broker.broadcast``) and the tensors streamed to them
(``services.weightgroup``); the files are then written and registered as for ``"files"``, so resume,
export and any server left out still have the version.

Failure never stops the learner: with no member, nothing is sent; a member that never joins or stops
answering costs at most ``publish.broadcast_timeout_s`` per wait, then the broadcast is abandoned, its
members are dropped from the board (they join again with their next heartbeat, and meanwhile load the
version's files) and the ledger records why. The ledger's ``broadcast`` event (version, members) comes
before the announcement, ``broadcast_sent`` (digest or error, seconds) after the send.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from broker.broadcast import Announcement, BroadcastBoard, seat
from broker.keys import Keys
from broker.ledger import Ledger
from services.config import PublishConfig

log = logging.getLogger("tandem.learner")


@dataclass(frozen=True)
class Sent:
    """One version's broadcast: its digest (None when it failed), members and seconds."""

    version: int
    members: list[str]
    seconds: float
    digest: str | None
    error: str | None = None


class Broadcaster:
    def __init__(self, redis, keys: Keys, publish: PublishConfig, host: str) -> None:
        self.board = BroadcastBoard(redis, keys)
        self.ledger = Ledger(redis, keys)
        self.publish = publish
        self.host = host

    async def send(self, version: int, tensors: dict) -> Sent | None:
        """Stream ``version`` to the members now on the board; None when there is none."""
        from services.weightgroup import BroadcastFailed, WeightGroup

        seats, world = seat(await self.board.members())
        if not seats:
            return None
        t0, timeout = time.perf_counter(), self.publish.broadcast_timeout_s
        name = f"v{version}"
        digest = error = None
        try:
            group = await asyncio.to_thread(WeightGroup, self.host, 0, 0, world, timeout_s=timeout, name=name)
            # in the ledger first: a server may hold the version before anything else is recorded
            await self.ledger.append("broadcast", version=version, members=sorted(seats))
            await self.board.announce(Announcement(version=version, host=self.host, port=group.port, group=name,
                                                   world=world, seats=seats, timeout_s=timeout,
                                                   created_at=time.time()))
            digest = await asyncio.to_thread(group.send, tensors)
        except BroadcastFailed as e:
            error = str(e)
            await self.board.drop(*seats)
            log.warning("broadcast of v%d to %s abandoned (%s); they load its files", version, sorted(seats), e)
        sent = Sent(version, sorted(seats), time.perf_counter() - t0, digest, error)
        await self.ledger.append("broadcast_sent", version=version, members=sent.members, digest=digest,
                                 seconds=round(sent.seconds, 4), **({"error": error} if error else {}))
        return sent
