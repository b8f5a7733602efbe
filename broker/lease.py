"""A lease: one holder at a time for a named thing, kept alive by renewing it.

The learner holds the lease of its run (``Keys.learner_lease``) for as long
as it trains it, so two learners never train one run: on Modal the control
plane spawns a learner per run and Modal retries a call that failed or timed
out; locally ``tandem up`` keeps a standing learner, and a second one can be
started by hand. Whoever comes second waits for the lease and, if its holder
keeps renewing it, gives up and names that holder.

The value is the holder's id; its TTL is the lease's length. Taking,
renewing and releasing compare the holder first, in one Lua script each, so
a holder whose lease expired and was taken by another cannot renew or
release the other's. A holder that finds its own id in the key (the same
Modal call retried after a timeout, whose earlier attempt was killed before
it released) takes it over at once instead of waiting for the TTL.

What it does not do: fence writes. A holder that stalls for longer than the
TTL (no renewal) loses the lease while it may still write; the learner
therefore ends itself at once when a renewal fails (``learner.service``),
and a lease of 30 s renewed every 10 s leaves 20 s of stall before that.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from broker.streams import raise_if_cancelled

# KEYS: lease. ARGV: holder, ttl ms. Returns nil when the holder has it now, else the current holder.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then
  return cur
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""

# KEYS: lease. ARGV: holder, ttl ms. 1 when renewed, 0 when the holder no longer has it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: holder. 1 when released, 0 when the holder did not have it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class Lease:
    """The lease at ``key`` as ``holder`` sees it; ``ttl_s``: how long it lasts without a renewal."""

    def __init__(self, redis: aioredis.Redis, key: str, holder: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("a lease needs ttl_s > 0")
        if not holder:
            raise ValueError("a lease needs a holder id")
        self.redis = redis
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def try_acquire(self) -> str | None:
        """Take the lease if it is free or already ours. None when we hold it now, else its holder."""
        other = await self._acquire(keys=[self.key], args=[self.holder, self._ttl_ms])
        return other.decode() if other else None

    async def acquire(self, wait_s: float = 0.0, poll_s: float = 0.5) -> str | None:
        """:meth:`try_acquire`, retried for up to ``wait_s`` while another holder has it (a holder
        that died stops renewing: its lease expires within ``ttl_s``). None when we hold it,
        else the holder that kept it."""
        deadline = time.monotonic() + wait_s
        while True:
            other = await self.try_acquire()
            raise_if_cancelled()
            if other is None or time.monotonic() >= deadline:
                return other
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    async def renew(self) -> bool:
        """Extend the lease by ``ttl_s``; False when we no longer hold it (it expired, or another took it)."""
        return bool(await self._renew(keys=[self.key], args=[self.holder, self._ttl_ms]))

    async def release(self) -> bool:
        """Give the lease up; False when we did not hold it."""
        return bool(await self._release(keys=[self.key], args=[self.holder]))

    async def current(self) -> str | None:
        """Who holds the lease now (None: nobody)."""
        value = await self.redis.get(self.key)
        return value.decode() if value is not None else None
