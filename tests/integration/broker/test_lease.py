"""broker.lease against a real Redis: one holder at a time, renewal, expiry, take-over by the same id."""

from __future__ import annotations

import asyncio
import time

from broker import Lease


async def test_one_holder_at_a_time_and_only_the_holder_renews_or_releases(redis, keys):
    a = Lease(redis, keys.learner_lease, "learner-a", ttl_s=30)
    b = Lease(redis, keys.learner_lease, "learner-b", ttl_s=30)
    assert await a.try_acquire() is None
    assert await b.try_acquire() == "learner-a"  # the second names the holder
    assert await a.current() == "learner-a"
    assert not await b.renew() and not await b.release()
    assert await a.renew()
    assert await a.release()
    assert await a.current() is None
    assert await b.try_acquire() is None and await b.current() == "learner-b"


async def test_racing_acquirers_get_exactly_one_holder(redis, keys):
    leases = [Lease(redis, keys.learner_lease, f"learner-{i}", ttl_s=30) for i in range(20)]
    others = await asyncio.gather(*[lease.try_acquire() for lease in leases])
    winners = [lease.holder for lease, other in zip(leases, others, strict=True) if other is None]
    assert len(winners) == 1
    assert set(others) == {None, winners[0]}


async def test_a_holder_that_stops_renewing_loses_the_lease_to_a_waiter(redis, keys):
    dead = Lease(redis, keys.learner_lease, "crashed", ttl_s=0.3)
    waiter = Lease(redis, keys.learner_lease, "next", ttl_s=30)
    assert await dead.try_acquire() is None
    t0 = time.monotonic()
    assert await waiter.acquire(wait_s=10, poll_s=0.05) is None  # waited for the expiry
    assert time.monotonic() - t0 < 10
    assert not await dead.renew()  # expired and taken: the old holder learns it has lost it
    assert await waiter.current() == "next"


async def test_a_live_holder_keeps_the_lease_against_a_waiter(redis, keys):
    live = Lease(redis, keys.learner_lease, "live", ttl_s=0.4)
    assert await live.try_acquire() is None

    async def keep() -> None:
        for _ in range(12):
            assert await live.renew()
            await asyncio.sleep(0.1)

    renewing = asyncio.create_task(keep())
    second = Lease(redis, keys.learner_lease, "second", ttl_s=30)
    assert await second.acquire(wait_s=1.0, poll_s=0.05) == "live"
    await renewing


async def test_the_same_holder_id_takes_its_own_lease_over_at_once(redis, keys):
    """A Modal call retried after a timeout carries the same id: it need not wait out the TTL."""
    first = Lease(redis, keys.learner_lease, "modal-call:fc-1", ttl_s=60)
    assert await first.try_acquire() is None
    retry = Lease(redis, keys.learner_lease, "modal-call:fc-1", ttl_s=60)
    assert await retry.acquire(wait_s=0) is None
    assert await redis.pttl(keys.learner_lease) > 50_000
