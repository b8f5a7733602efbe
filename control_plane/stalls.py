"""Stalls a process cannot see itself: a service whose heartbeat stops.

Every service that works on a run beats in the run's heartbeat hash
(``Keys.heartbeats``: service -> Unix time, every 0.5 s from a thread of its
own; :mod:`services.timeline`) and removes its field when it stops working on
the run. A process that is stopped (SIGSTOP), frozen or swapped out stops
beating without knowing it; its watchdogs cannot fire either. The control
plane's :class:`StallMonitor` polls the active run's heartbeats and, when one
has been silent for longer than ``watchdog.stall_s``, waits for it to beat
again, then records one incident (``waited_s`` = the silence; ``tandem
status``, the dashboard, the main job's ``summary.json``) and a ``stalled``
span on that service's timeline (``tandem trace``). A service still silent
when the run ends is recorded then. Only a silence the monitor itself saw
counts, so a control plane that was stopped does not report its own pause as
everyone's.

The heartbeat is written with the service's clock and read with the control
plane's: clocks a few seconds apart shift the silence by that much (the bound
is tens of seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis

from broker.keys import Keys
from broker.streams import raise_if_cancelled
from services import timeline
from services.config import RunConfig
from services.runs import RunStore
from services.watchdog import IncidentLog, incident, report

log = logging.getLogger("tandem.control.stalls")

POLL_S = 1.0
"""How often the monitor reads the active run's heartbeats (at most a quarter of ``watchdog.stall_s``)."""


class StallMonitor:
    """Watches the active run's heartbeats in a task of the control plane (``start``/``stop``)."""

    def __init__(self, redis: aioredis.Redis, *, poll_s: float = POLL_S) -> None:
        self.redis = redis
        self.runs = RunStore(redis)
        self.poll_s = poll_s
        self.run_id: str | None = None
        self.bound_s = 30.0
        self.last: dict[str, float] = {}
        """service -> the newest heartbeat seen."""
        self.silent: dict[str, float] = {}
        """service -> its last heartbeat before a silence longer than the bound, seen while it lasted."""
        self._task: asyncio.Task | None = None

    def start(self) -> StallMonitor:
        self._task = asyncio.create_task(self.run(), name="stalls")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # Redis away a moment: the next tick tries again  # noqa: BLE001
                log.exception("stall monitor: reading the heartbeats failed; retrying")
            raise_if_cancelled()
            await asyncio.sleep(min(self.poll_s, self.bound_s / 4))

    async def tick(self, now: float | None = None) -> None:
        """One poll of the active run (or, when it has ended, the last poll of the run followed)."""
        active = await self.runs.active()
        if self.run_id is not None and (active is None or active.run_id != self.run_id):
            await self._ended(now)
        if active is None:
            return
        if active.run_id != self.run_id:
            self.run_id, self.last, self.silent = active.run_id, {}, {}
            self.bound_s = RunConfig.model_validate(active.config).watchdog.stall_s
        await self.check(Keys(self.run_id), now)

    async def check(self, keys: Keys, now: float | None = None) -> None:
        now = time.time() if now is None else now
        beats = {k.decode(): float(v) for k, v in (await self.redis.hgetall(keys.heartbeats)).items()}
        for service, t in beats.items():
            before = self.last.get(service)
            self.last[service] = t
            if service in self.silent:
                # A beat stamped before the silence grew past the bound was sent late (the process was
                # stopped between stamping and sending it): only a beat stamped after that ends the silence.
                if t - self.silent[service] > self.bound_s:
                    await self._record(keys, service, self.silent.pop(service), t, resumed=True)
            elif now - t > self.bound_s and before is not None:
                self.silent.setdefault(service, t)
        for service in set(self.silent) - set(beats):  # it stopped working on the run (ended, or restarted anew)
            await self._record(keys, service, self.silent.pop(service), now, resumed=False)

    async def _ended(self, now: float | None) -> None:
        keys = Keys(self.run_id)
        now = time.time() if now is None else now
        for service, t in list(self.silent.items()):
            await self._record(keys, service, t, now, resumed=False)
        self.run_id, self.last, self.silent = None, {}, {}

    async def _record(self, keys: Keys, service: str, since: float, until: float, *, resumed: bool) -> None:
        gap = until - since
        inc = incident(
            f"{service} (its heartbeat)", "nothing it could see: its process did not run (stopped, frozen or swapped out)",
            waited_s=gap, limit_s=self.bound_s, field="watchdog.stall_s",
            action=("it beat again; recorded, the run went on" if resumed
                    else "it did not beat again while working on the run"),
            source=service)
        inc = inc.model_copy(update={"at": since})
        await report(inc, IncidentLog(self.redis, keys, source=service))
        await timeline.append(self.redis, keys, [timeline.Span("stalled", service, "stalled", since, until,
                                                               {"silent_s": round(gap, 3), "resumed": resumed})])
