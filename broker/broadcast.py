"""The Redis side of a weight broadcast (``publish.transport = "broadcast"``): who joins, and where.

Rollout servers that can receive a broadcast say so with :meth:`BroadcastBoard.join` (server id and
the number of vLLM workers, i.e. ranks, it brings), renewed as a heartbeat. For each version the
learner's rank 0 reads the live members, seats them (:func:`seat`: rank 0 is the learner, each
server gets consecutive ranks for its workers), opens the group's store and posts one
:class:`Announcement` (a key plus a pub/sub notification, read like the weight registry: subscribe,
then poll, so a lost message is only late). A server finds its seat in it, joins and receives
(``services.weightgroup``, ``rollout_server.transports.BroadcastTransport``).

A server the learner gave up on (it never joined, or died half way: ``publish.broadcast_timeout_s``)
is :meth:`dropped <BroadcastBoard.drop>` from the members until it joins again; it catches up from the
version's files through the weight registry, as every server does for a version it missed.

The announcement is not the version's registry entry: the registry still records each version (uri
and sha256 of its files) once the files are written; the ledger gets a ``broadcast`` event from the
learner before it announces (version, members), ``broadcast_sent`` after the send (digest, seconds) and a
``received`` event from each server that loaded it.
"""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from broker.keys import Keys
from broker.streams import wait_notified


class Announcement(BaseModel):
    """One version's group: the store's address, the world size and every member's first rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=1)
    host: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)
    group: str = Field(min_length=1, description="Key prefix of this version's group in the store.")
    world: int = Field(ge=2, description="1 (the learner) + every member's workers.")
    seats: dict[str, int] = Field(description="server_id -> its first rank (its workers take the next ones).")
    timeout_s: float = Field(gt=0)
    created_at: float


def seat(members: dict[str, int]) -> tuple[dict[str, int], int]:
    """(server_id -> first rank, world size) for ``members`` (server_id -> workers), in server-id order."""
    seats, rank = {}, 1
    for server in sorted(members):
        if members[server] > 0:
            seats[server] = rank
            rank += members[server]
    return seats, rank


class BroadcastBoard:
    """Members and announcements of one run's weight broadcasts."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def join(self, server_id: str, workers: int) -> None:
        """``server_id`` (with ``workers`` ranks) is ready for the next broadcast; call it as a heartbeat."""
        await self.redis.hset(self.keys.weights_members, server_id, json.dumps([workers, time.time()]))

    async def drop(self, *server_ids: str) -> None:
        """Leave ``server_ids`` out of the next broadcasts (until they join again)."""
        if server_ids:
            await self.redis.hdel(self.keys.weights_members, *server_ids)

    async def members(self, max_age_s: float = 30.0) -> dict[str, int]:
        """server_id -> workers, of the members that joined within ``max_age_s``."""
        now, out = time.time(), {}
        for server, raw in (await self.redis.hgetall(self.keys.weights_members)).items():
            workers, at = json.loads(raw)
            if now - at <= max_age_s:
                out[server.decode()] = int(workers)
        return out

    async def announce(self, a: Announcement) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.weights_broadcast, a.model_dump_json())
        pipe.publish(self.keys.weights_broadcast_channel, a.version)
        await pipe.execute()

    async def latest(self) -> Announcement | None:
        raw = await self.redis.get(self.keys.weights_broadcast)
        return None if raw is None else Announcement.model_validate_json(raw)

    async def wait_seat(self, server_id: str, after: int, timeout_s: float) -> Announcement | None:
        """The newest announcement of a version above ``after`` that seats ``server_id``, waiting up to
        ``timeout_s`` (:func:`~broker.streams.wait_notified`)."""

        async def seated() -> Announcement | None:
            a = await self.latest()
            return a if a is not None and a.version > after and server_id in a.seats else None

        return await wait_notified(self.redis, self.keys.weights_broadcast_channel, seated, timeout_s)
