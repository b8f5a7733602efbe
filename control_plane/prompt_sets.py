"""Prompt sets: uploaded JSON lines, validated line by line and stored in Redis.

Who talks to whom: a client (``tandem submit``, curl) uploads a file to the
control plane's ``POST /v1/prompt-sets``; the route hands the body, as it
streams in, to :meth:`PromptSetStore.upload`, which parses it in a worker
thread and writes it to Redis (AOF). ``POST /v1/runs`` reads the lines back
(``control_plane.groups``).

The line format and its validation are ``services.prompt_lines``. Prompt-set
ids are content hashes, so uploading the same file twice stores it once. A
set naming python reward functions the reward server refuses is not stored
(``control_plane.reward_functions``).
``GET /v1/prompt-sets`` lists the stored sets (:meth:`PromptSetStore.list`) and
``DELETE /v1/prompt-sets/{id}`` removes one (:meth:`PromptSetStore.delete`): a
run already created from it keeps its prompts (enqueued, and its held-out
prompts copied, when it was created).

What an upload may cost (``ControlSettings``):

- the event loop: nothing per line. Chunks are parsed, validated and
  msgpack-encoded in a worker thread, :data:`FEED_BYTES` at a time, so the
  control plane answers ``/healthz`` and other requests during a
  ``max_prompt_set_bytes`` upload; Redis is written :data:`PUSH_LINES` lines
  per round trip;
- memory: the encoded lines (what Redis will hold, about the body's size)
  plus one batch and one line being read; no decoded copy of the set;
- Redis: at most ``max_prompt_set_bytes`` stored per set (413), at most
  ``max_stored_prompt_set_bytes`` for all sets together (507), and
  ``max_prompt_set_lines`` lines (422).
- concurrency: at most :data:`MAX_UPLOADS` uploads are parsed at once; one
  more gets 429 with a ``Retry-After`` of about one recent upload's time
  before its body is read, so a burst of uploads holds at most
  ``MAX_UPLOADS`` sets in memory and in the worker threads.

Storing is all or nothing: the lines go to a staging list (expiring after
:data:`STAGING_TTL_S`, in case the control plane dies mid-upload), which one
transaction renames to the set's list while writing its meta; readers look
at the meta first, so they never see a partial set.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from broker.keys import PROMPT_SETS, check_run_id, prompt_set, prompt_set_meta
from control_plane.reward_functions import FunctionCheck, Named, line_functions
from control_plane.settings import ControlSettings
from services.app import ServiceError
from services.prompt_lines import LineError, LineParser
from services.wire import PromptSetInfo

FEED_BYTES = 256 << 10
"""Body bytes handed to the worker thread at a time (small chunks are joined up to this)."""
PUSH_LINES = 1000
"""Encoded lines per ``RPUSH`` round trip while staging."""
STAGING_TTL_S = 3600
"""A staging list left by a control plane that died mid-upload expires after this long."""
MAX_UPLOADS = 4
"""Uploads parsed and stored at once (each holds its encoded lines, up to ``max_prompt_set_bytes``);
beyond, 429 with ``Retry-After``."""


class StoredLines(LineParser):
    """The upload parser: each good line kept msgpack-encoded (what Redis stores), hashed as it comes.

    ``encoded`` replaces the parent's ``lines``; 413 (:class:`ServiceError`)
    as soon as the encoded lines pass ``max_prompt_set_bytes``.
    """

    def __init__(self, default_type: str, settings: ControlSettings) -> None:
        super().__init__(
            default_type, max_lines=settings.max_prompt_set_lines, max_line_bytes=settings.max_prompt_line_bytes
        )
        self.max_stored = settings.max_prompt_set_bytes
        self.encoded: list[bytes] = []
        self.stored_bytes = 0
        self.functions: Named = {}
        """Python reward function -> (line, field) of the first line that names it."""
        self._digest = hashlib.sha256()

    def keep(self, stored: dict) -> None:
        for field, function, keywords in line_functions(stored, self.default_type):
            self.functions.setdefault((function, keywords), (self._lineno, field))
        encoded = msgpack.packb(stored, use_bin_type=True)
        self._digest.update(len(encoded).to_bytes(8, "little") + encoded)
        self.encoded.append(encoded)
        self.stored_bytes += len(encoded)
        if self.stored_bytes > self.max_stored:
            raise ServiceError(
                413, f"prompt set over {self.max_stored} bytes once stored (its lines with the specs' defaults)"
            )

    @property
    def set_id(self) -> str:
        """The content hash of the lines kept so far."""
        return f"ps-{self._digest.hexdigest()[:20]}"


async def _batched(chunks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """``chunks`` joined into pieces of at least ``size`` bytes (the last may be shorter)."""
    pending: list[bytes] = []
    held = 0
    async for chunk in chunks:
        pending.append(chunk)
        held += len(chunk)
        if held >= size:
            yield b"".join(pending)
            pending, held = [], 0
    if pending:
        yield b"".join(pending)


class PromptSetStore:
    """Stored prompt sets: a Redis list of msgpack lines plus a meta hash per set.

    ``settings`` gives the caps (``ControlSettings``' defaults when None).
    """

    def __init__(self, redis: aioredis.Redis, settings: ControlSettings | None = None,
                 functions: FunctionCheck | None = None) -> None:
        self.redis = redis
        self.settings = settings if settings is not None else ControlSettings.model_construct()
        self.functions = functions
        """Asks the reward server about the python reward functions a set names (None: not asked)."""
        self.uploading = 0
        self._upload_s = 1.0  # moving average of an upload's time, for Retry-After

    async def upload(self, chunks: AsyncIterable[bytes], default_type: str, owner: str | None = None) -> PromptSetInfo:
        """Parse ``chunks`` (a request body as it streams) off the event loop, then store the set, owned
        by ``owner`` (``services.security.owner_id``; a set of the same content stored before keeps its owner).

        Raises :class:`ServiceError`: 422 naming each bad line and field, 413 when
        the stored form is too large, 507 when every set together would be, 429
        (before ``chunks`` is read) while :data:`MAX_UPLOADS` others are in progress.
        """
        if self.uploading >= MAX_UPLOADS:
            raise ServiceError(429, f"{self.uploading} prompt-set uploads in progress, the most this control "
                                    "plane takes at once; retry later", retry_after=max(1.0, self._upload_s))
        self.uploading += 1
        start = time.monotonic()
        try:
            return await self._upload(chunks, default_type, owner)
        finally:
            self.uploading -= 1
            self._upload_s = 0.8 * self._upload_s + 0.2 * (time.monotonic() - start)

    async def _upload(self, chunks: AsyncIterable[bytes], default_type: str, owner: str | None) -> PromptSetInfo:
        parser = StoredLines(default_type, self.settings)
        try:
            async for piece in _batched(chunks, FEED_BYTES):
                await asyncio.to_thread(parser.feed, piece)
            await asyncio.to_thread(parser.finish)
        except LineError as e:
            raise ServiceError(422, str(e), errors=e.errors) from None
        refused = await self.functions.refusals(parser.functions) if self.functions is not None else []
        if refused:
            raise ServiceError(422, str(LineError(refused)), errors=refused)
        return await self._store(parser, owner)

    async def _store(self, parsed: StoredLines, owner: str | None = None) -> PromptSetInfo:
        """Stage the encoded lines, then publish them with the meta in one transaction."""
        set_id = parsed.set_id
        stored = await self.info(set_id)
        if stored is not None:
            return stored  # the same content is already stored
        staging = prompt_set(f"{set_id}.up-{secrets.token_hex(4)}")
        try:
            for i in range(0, len(parsed.encoded), PUSH_LINES):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.rpush(staging, *parsed.encoded[i : i + PUSH_LINES])
                    pipe.expire(staging, STAGING_TTL_S)
                    await pipe.execute()
            return await self._publish(parsed, set_id, staging, owner)
        finally:
            await self.redis.delete(staging)  # already renamed when stored; left over on any failure

    async def _publish(self, parsed: StoredLines, set_id: str, staging: str, owner: str | None) -> PromptSetInfo:
        info = PromptSetInfo(
            id=set_id, count=parsed.count, bytes=parsed.nbytes, created_at=time.time(), reward_types=parsed.types,
            forms=parsed.forms,
        )
        meta = {
            "count": info.count, "bytes": info.bytes, "stored": parsed.stored_bytes,
            "created_at": repr(info.created_at), "reward_types": json.dumps(parsed.types),
            "forms": json.dumps(parsed.forms), "owner": owner or "",
        }
        cap = self.settings.max_stored_prompt_set_bytes
        for _attempt in range(20):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    # a set stored meanwhile changes PROMPT_SETS: the total below is retaken
                    await pipe.watch(prompt_set_meta(set_id), PROMPT_SETS)
                    if await pipe.exists(prompt_set_meta(set_id)):
                        break
                    total = await self.stored_bytes()
                    if total + parsed.stored_bytes > cap:
                        raise ServiceError(
                            507,
                            f"storing this prompt set ({parsed.stored_bytes} bytes) would take the stored prompt "
                            f"sets past {cap} bytes ({total} stored; TANDEM_CONTROL_MAX_STORED_PROMPT_SET_BYTES)",
                        )
                    pipe.multi()
                    pipe.rename(staging, prompt_set(set_id))
                    pipe.persist(prompt_set(set_id))
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

    async def stored_bytes(self) -> int:
        """Stored bytes of every prompt set (sets stored before this was recorded count their upload bytes)."""
        ids = await self.redis.zrange(PROMPT_SETS, 0, -1)
        if not ids:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for set_id in ids:
                pipe.hmget(prompt_set_meta(set_id.decode()), ["stored", "bytes"])
            rows = await pipe.execute()
        return sum(int(stored or nbytes or 0) for stored, nbytes in rows)

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
            reward_types=json.loads(f["reward_types"]), forms=json.loads(f.get("forms", "{}")),
        )

    async def owner(self, set_id: str) -> str | None:
        """Who uploaded the set (``services.security.owner_id``); None if no token did, or no such set."""
        try:
            owner = await self.redis.hget(prompt_set_meta(check_run_id(set_id)), "owner")
        except ValueError:
            return None
        return owner.decode() if owner else None

    async def list(self, limit: int) -> list[PromptSetInfo]:
        """The stored sets' meta, newest first (at most ``limit``)."""
        ids = [i.decode() for i in await self.redis.zrevrange(PROMPT_SETS, 0, limit - 1)]
        infos = [await self.info(set_id) for set_id in ids]
        return [info for info in infos if info is not None]  # deleted meanwhile

    async def delete(self, set_id: str) -> PromptSetInfo | None:
        """Remove a set (its lines, meta and index entry in one transaction); its meta, or None if no such set."""
        info = await self.info(set_id)
        if info is None:
            return None
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(prompt_set(set_id), prompt_set_meta(set_id))
            pipe.zrem(PROMPT_SETS, set_id)
            await pipe.execute()
        return info

    async def lines(self, set_id: str) -> list[dict]:
        """Every stored line, in file order (``{"prompt", "spec"}`` or ``{"prompt", "fields"}``); decoded
        in a worker thread."""
        raw = await self.redis.lrange(prompt_set(set_id), 0, -1)
        return await asyncio.to_thread(lambda: [msgpack.unpackb(r, raw=False) for r in raw])
