"""A bounded warm pool of sandboxes: borrow one, use it, give it back or have it replaced.

Used by the gVisor backend (long-lived ``runsc`` sandboxes) and the Modal
backend (``modal.Sandbox`` objects). An item is replaced, in the
background, after ``max_uses`` loans, when its user discards it (it
misbehaved), or when it is dead or about to die: ``alive(item)`` is false
(default: its ``alive`` attribute), it is older than ``max_age_s`` or it sat
idle longer than ``max_idle_s``. Those checks run when an item is about to
be lent (a dead one is retired and the next is tried) and every
``sweep_s`` over the idle items, so a sandbox whose lifetime or idle
timeout is near is replaced before a job meets it: Modal ends a sandbox at
its ``timeout`` and after ``idle_timeout`` without work. Creation is
rate-limited (``min_spawn_interval_s``) so a burst of failures cannot turn
into a burst of sandbox creations, and a failed creation is retried with
back-off instead of failing requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from reward_server.sandbox.base import SandboxError

T = TypeVar("T")
log = logging.getLogger("tandem.reward.pool")


class Loan(Generic[T]):
    def __init__(self, item: T) -> None:
        self.item = item
        self.discarded = False

    def discard(self) -> None:
        """Do not reuse this item: destroy it and start a replacement."""
        self.discarded = True


class Pool(Generic[T]):
    def __init__(
        self,
        spawn: Callable[[], Awaitable[T]],
        destroy: Callable[[T], Awaitable[None]],
        *,
        size: int,
        max_uses: int,
        min_spawn_interval_s: float = 0.0,
        spawn_timeout_s: float = 120.0,
        alive: Callable[[T], Awaitable[bool]] | None = None,
        max_age_s: float | None = None,
        max_idle_s: float | None = None,
        sweep_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spawn_fn, self._destroy = spawn, destroy
        self.size, self.max_uses = size, max_uses
        self.min_spawn_interval_s, self.spawn_timeout_s = min_spawn_interval_s, spawn_timeout_s
        self._alive = alive or _alive_attribute
        self.max_age_s, self.max_idle_s, self.sweep_s, self._clock = max_age_s, max_idle_s, sweep_s, clock
        self._idle: asyncio.Queue[T] = asyncio.Queue()
        self._uses: dict[int, int] = {}
        self._born: dict[int, float] = {}
        self._used_at: dict[int, float] = {}
        self.retired_stale = 0
        """Items retired because they were dead, too old or idle too long (not after a use)."""
        self._tasks: set[asyncio.Task] = set()
        self._spawn_lock = asyncio.Lock()
        self._last_spawn = 0.0
        self._started = False
        self._closed = False
        self.spawned = 0
        self.live = 0

    async def _spawn(self) -> T:
        async with self._spawn_lock:  # the creation rate limit
            wait = self._last_spawn + self.min_spawn_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_spawn = time.monotonic()
        item = await asyncio.wait_for(self._spawn_fn(), self.spawn_timeout_s)
        self._uses[id(item)] = 0
        self._born[id(item)] = self._used_at[id(item)] = self._clock()
        self.spawned += 1
        self.live += 1
        return item

    async def start(self) -> None:
        """Create the pool's items; raise SandboxError if the first one cannot be created."""
        if self._started:
            return
        self._started = True
        first = await self._spawn()
        self._idle.put_nowait(first)
        for _ in range(self.size - 1):
            self._background(self._refill())
        if self.max_age_s is not None or self.max_idle_s is not None:
            self._background(self._sweep_forever())

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, item: T) -> None:
        self._uses.pop(id(item), None)
        self._born.pop(id(item), None)
        self._used_at.pop(id(item), None)
        self.live -= 1
        try:
            await self._destroy(item)
        except (OSError, SandboxError) as e:  # a sandbox that will not die is logged; the pool goes on
            log.error("could not destroy a sandbox: %s", e)

    async def _refill(self) -> None:
        delay = 0.5
        while not self._closed:
            try:
                self._idle.put_nowait(await self._spawn())
                return
            except (OSError, SandboxError, TimeoutError) as e:
                log.error("could not start a sandbox (retrying in %.1f s): %s", delay, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    @contextlib.asynccontextmanager
    async def borrow(self) -> AsyncIterator[Loan[T]]:
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        if not self._started:
            await self.start()
        loan = Loan(await self._usable())
        try:
            yield loan
        finally:
            item = loan.item
            uses = self._uses.get(id(item), 0) + 1
            self._uses[id(item)] = uses
            self._used_at[id(item)] = self._clock()
            if self._closed:
                await self._retire(item)
            elif loan.discarded or uses >= self.max_uses or not await self._fit(item):
                self._background(self._replace(item))
            else:
                self._idle.put_nowait(item)

    async def _usable(self) -> T:
        """The next idle item that is alive and not about to die; the others are replaced."""
        while True:
            item = await self._idle.get()
            if await self._fit(item):
                return item
            self.retired_stale += 1
            self._background(self._replace(item))

    async def _fit(self, item: T) -> bool:
        """Alive, younger than ``max_age_s`` and idle for less than ``max_idle_s``."""
        now = self._clock()
        if self.max_age_s is not None and now - self._born.get(id(item), now) >= self.max_age_s:
            return False
        if self.max_idle_s is not None and now - self._used_at.get(id(item), now) >= self.max_idle_s:
            return False
        try:
            return await self._alive(item)
        except (OSError, SandboxError, TimeoutError) as e:  # could not ask: treat it as gone
            log.warning("could not tell whether a sandbox is alive: %s", e)
            return False

    async def sweep(self) -> int:
        """Replace every idle item that is dead or about to die; how many were replaced."""
        keep, replaced = [], 0
        while not self._idle.empty():
            item = self._idle.get_nowait()
            if await self._fit(item):
                keep.append(item)
            else:
                replaced += 1
                self._background(self._replace(item))
        for item in keep:
            self._idle.put_nowait(item)
        self.retired_stale += replaced
        return replaced

    async def _sweep_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.sweep_s)
            await self.sweep()

    async def _replace(self, item: T) -> None:
        await self._retire(item)
        await self._refill()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while not self._idle.empty():
            await self._retire(self._idle.get_nowait())


async def _alive_attribute(item) -> bool:
    """The default liveness check: the item's ``alive`` attribute (gVisor's container), else alive."""
    return getattr(item, "alive", True)
