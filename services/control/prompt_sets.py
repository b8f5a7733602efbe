"""Prompt sets: uploaded JSON lines, validated line by line and stored in Redis.

Who talks to whom: a client (``tandem submit``, curl) uploads a file to the
control plane's ``POST /v1/prompt-sets``; the route feeds the body, chunk by
chunk as it arrives, to :class:`LineParser` and hands the result to
:class:`PromptSetStore`, which writes it to Redis (AOF) in one transaction.
``POST /v1/runs`` reads the lines back (``services.control.groups``).

The line format and its validation are ``services.promptsets``. Prompt-set
ids are content hashes, so uploading the same file twice stores it once.
"""

from __future__ import annotations

import hashlib
import json
import time

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from broker.keys import PROMPT_SETS, check_run_id, prompt_set, prompt_set_meta
from services.wire import PromptSetInfo


class PromptSetStore:
    """Stored prompt sets: a Redis list of msgpack lines plus a meta hash per set."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def save(self, lines: list[dict], nbytes: int, types: dict[str, int]) -> PromptSetInfo:
        """Store ``lines`` atomically (all or nothing) and return the set's info."""
        encoded = [msgpack.packb(line, use_bin_type=True) for line in lines]
        digest = hashlib.sha256()
        for e in encoded:
            digest.update(len(e).to_bytes(8, "little") + e)
        set_id = f"ps-{digest.hexdigest()[:20]}"
        info = PromptSetInfo(id=set_id, count=len(lines), bytes=nbytes, created_at=time.time(), reward_types=types)
        meta = {"count": info.count, "bytes": nbytes, "created_at": repr(info.created_at), "reward_types": json.dumps(types)}
        for _attempt in range(20):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(prompt_set_meta(set_id))
                    if await pipe.exists(prompt_set_meta(set_id)):
                        break  # the same content is already stored
                    pipe.multi()
                    pipe.delete(prompt_set(set_id))
                    for i in range(0, len(encoded), 1000):
                        pipe.rpush(prompt_set(set_id), *encoded[i : i + 1000])
                    pipe.hset(prompt_set_meta(set_id), mapping=meta)
                    pipe.zadd(PROMPT_SETS, {set_id: info.created_at})
                    await pipe.execute()
                    return info
                except WatchError:
                    continue
        stored = await self.info(set_id)
        if stored is None:
            raise RuntimeError(f"prompt set {set_id} could not be stored")
        return stored

    async def info(self, set_id: str) -> PromptSetInfo | None:
        """The set's meta, or None when no such set is stored."""
        try:
            key = prompt_set_meta(check_run_id(set_id))
        except ValueError:
            return None
        raw = await self.redis.hgetall(key)
        if not raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return PromptSetInfo(
            id=set_id, count=int(f["count"]), bytes=int(f["bytes"]), created_at=float(f["created_at"]),
            reward_types=json.loads(f["reward_types"]),
        )

    async def lines(self, set_id: str) -> list[dict]:
        """Every stored line, in file order (``{"prompt", "spec"}`` or ``{"prompt", "fields"}``)."""
        raw = await self.redis.lrange(prompt_set(set_id), 0, -1)
        return [msgpack.unpackb(r, raw=False) for r in raw]
