"""Watchdogs: a wait past its bound becomes a clear error, never a silent stall.

The run config's ``[watchdog]`` section (``services.config.WatchdogConfig``)
sets the bounds; this module is the one mechanism behind all of them. When a
bound expires, the waiter

1. logs ``<what> has waited <n> s on <on> (limit <m> s, config <field>); <action>``
   with the stack of the stuck thread or task;
2. records an :class:`~services.wire.Incident` in the run's incidents stream
   (``Keys.incidents``), which ``GET /v1/runs/{id}`` returns, so ``tandem
   status`` and the dashboard show it;
3. takes the configured action:

   - :func:`bounded` (an awaitable) and :func:`in_thread` + :func:`bounded`
     (a blocking call moved to a thread of its own) raise :class:`Stalled`,
     which the caller handles (refuse and retry later, redeliver a group). A
     ``Stalled`` is a ``ServiceError`` 503 with ``Retry-After``, so an HTTP
     route that lets it through answers 503, not 500. A thread that cannot
     be interrupted (a blocking read) is abandoned; it is a daemon thread, so
     it never keeps the process from exiting.
   - :class:`Watchdog` guards a blocking call in the calling thread that
     nothing can interrupt (a hung DeepSpeed step or collective): a monitor
     thread logs and records the incident, then ends the process with
     :data:`EXIT_STALLED`, so the supervisor restarts the service. A call
     stuck in C code holding the GIL stops that thread too; faulthandler's
     backstop then dumps every stack and exits 1.

Who writes incidents: the process that waited, with :class:`IncidentLog`
(async Redis) or :class:`SyncIncidentLog` (a plain socket with its own
timeouts, for the monitor thread of a process whose event loop is blocked).
Who reads them: the control plane (:meth:`IncidentLog.recent`). Light
module: no torch.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from broker.keys import Keys
from services.app import ServiceError
from services.wire import Incident

log = logging.getLogger("tandem.watchdog")

T = TypeVar("T")

EXIT_STALLED = 4
"""Exit status of a process a :class:`Watchdog` ended (the rollout server uses 1 and 3)."""
MAX_INCIDENTS = 1000
"""Incidents kept per run (the stream is trimmed to about this many)."""
STACK_CHARS = 8000
"""Most characters of a stack kept in an incident (the log has it whole)."""


class Stalled(ServiceError):
    """A bounded wait expired; ``incident`` says what waited on what. Maps to HTTP 503."""

    def __init__(self, incident: Incident) -> None:
        super().__init__(503, message(incident), retry_after=5)
        self.incident = incident


class IncidentSink(Protocol):
    async def append(self, incident: Incident) -> None: ...


def message(inc: Incident) -> str:
    """The one line every watchdog logs: what waited on what, how long, the bound, the action."""
    limit = f"limit {inc.limit_s:g} s, " if inc.limit_s is not None else ""
    return f"{inc.what} has waited {inc.waited_s:.1f} s on {inc.on} ({limit}config {inc.field}); {inc.action}"


def incident(what: str, on: str, *, waited_s: float, limit_s: float | None, field: str, action: str,
             source: str = "", stack: str = "") -> Incident:
    return Incident(
        at=time.time(), source=source[:200], what=what[:500], on=on[:500], waited_s=max(0.0, waited_s),
        limit_s=limit_s, field=field[:100], action=action[:500], stack=stack[-STACK_CHARS:],
    )


# -- stacks ------------------------------------------------------------------------------


def thread_stack(ident: int | None) -> str:
    """The current stack of thread ``ident`` (empty if it has ended)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


def named_thread_stacks(prefix: str) -> str:
    """Stacks of the live threads whose name starts with ``prefix``."""
    return "".join(
        f"thread {t.name}:\n{thread_stack(t.ident)}" for t in threading.enumerate() if t.name.startswith(prefix)
    )


def task_stack(task: asyncio.Future) -> str:
    """Where an asyncio task is suspended (its coroutine frames; none for a bare future)."""
    if not isinstance(task, asyncio.Task):
        return ""
    out = io.StringIO()
    task.print_stack(file=out)
    return out.getvalue()


# -- async bounds -------------------------------------------------------------------------


async def bounded(
    aw: Awaitable[T], *, what: str, on: str, limit_s: float, field: str, action: str,
    sink: IncidentSink | None = None, source: str = "", thread_prefix: str | None = None,
) -> T:
    """``await aw`` for at most ``limit_s``; past it, log and record the incident and raise :class:`Stalled`.

    ``aw`` is cancelled when the bound expires (a shielded one keeps running).
    ``thread_prefix``: the work runs in threads of that name (:func:`in_thread`);
    their stacks go into the incident instead of the awaiting task's.
    """
    task = asyncio.ensure_future(aw)
    t0 = time.monotonic()
    done, _ = await asyncio.wait([task], timeout=limit_s)
    if done:
        return task.result()
    stack = named_thread_stacks(thread_prefix) if thread_prefix else task_stack(task)
    task.cancel()
    task.add_done_callback(_consume)
    inc = incident(what, on, waited_s=time.monotonic() - t0, limit_s=limit_s, field=field, action=action,
                   source=source, stack=stack)
    await report(inc, sink)
    raise Stalled(inc)


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("abandoned wait ended later with %r", task.exception())


async def report(inc: Incident, sink: IncidentSink | None) -> None:
    """Log the incident with its stack and record it; a failing record is logged, never raised."""
    log.error("%s%s", message(inc), f"\n{inc.stack}" if inc.stack else "")
    if sink is None:
        return
    try:
        await asyncio.wait_for(sink.append(inc), timeout=5.0)
    except Exception as e:  # noqa: BLE001  the incident is in the log; Redis trouble must not mask it
        log.error("could not record the incident: %r", e)


def in_thread(fn: Callable[..., T], *args: Any, name: str) -> asyncio.Future[T]:
    """Run ``fn(*args)`` in a new daemon thread called ``name``; a future of its result.

    Unlike ``asyncio.to_thread``, a call that never returns (a read of a FIFO
    nobody writes) holds only its own thread, not a slot of the loop's shared
    executor; combined with :func:`bounded`, the caller stops waiting and the
    process can still exit.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001  handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


# -- threads nothing can interrupt ---------------------------------------------------------------


@dataclass(frozen=True)
class _Guard:
    deadline: float
    t0: float
    what: str
    on: str
    limit_s: float
    field: str
    action: str
    thread: int


class Watchdog:
    """Deadlines on blocking calls in any thread; an expired one ends the process.

    ``with dog.guard(what, on, limit_s=..., field=...):`` around a call that
    may hang where no exception can reach it (a DeepSpeed step, a gloo
    collective). A daemon monitor thread, started on first use, checks the
    deadlines; when one passes it logs the message with the guarded thread's
    stack, records the incident (``sink``: a :class:`SyncIncidentLog`; its
    own timeouts keep a dead Redis from holding the exit) and calls
    ``exit(EXIT_STALLED)`` (``os._exit`` by default: the stuck thread cannot
    be joined, so a normal exit would wait for it).

    A call stuck in C code that holds the GIL (``torch.save`` to a hung
    filesystem) stops every Python thread, the monitor too. For that case,
    ``backstop_s`` after the earliest deadline, :mod:`faulthandler`'s C
    watchdog thread, which needs no GIL, dumps every thread's stack to
    stderr (``Timeout (h:mm:ss)!``) and exits with status 1; no incident is
    recorded then. ``faulthandler`` keeps one such timer per process: use one
    Watchdog with a backstop per process (``backstop_s=None`` for others).
    """

    def __init__(self, *, sink: SyncIncidentLog | None = None, source: str = "", poll_s: float = 0.2,
                 exit: Callable[[int], None] = os._exit, backstop_s: float | None = 10.0) -> None:
        self.sink = sink
        self.source = source
        self.poll_s = poll_s
        self.backstop_s = backstop_s
        self._exit = exit
        self._guards: dict[int, _Guard] = {}
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._next = 0

    @contextmanager
    def guard(self, what: str, on: str, *, limit_s: float, field: str,
              action: str = "the process exits for a restart") -> Iterator[None]:
        t0 = time.monotonic()
        with self._lock:
            key = self._next
            self._next += 1
            self._guards[key] = _Guard(t0 + limit_s, t0, what, on, limit_s, field, action, threading.get_ident())
            self._arm_backstop()
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._watch, name="tandem-watchdog", daemon=True)
                self._monitor.start()
        try:
            yield
        finally:
            with self._lock:
                self._guards.pop(key, None)
                self._arm_backstop()

    def _arm_backstop(self) -> None:
        """(Re)set faulthandler's timer to the earliest deadline + ``backstop_s``; cancel it when none."""
        if self.backstop_s is None:
            return
        if not self._guards:
            faulthandler.cancel_dump_traceback_later()
            return
        first = min(g.deadline for g in self._guards.values())
        faulthandler.dump_traceback_later(max(0.1, first + self.backstop_s - time.monotonic()), exit=True,
                                          file=sys.__stderr__)

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self._lock:
                expired = [g for g in self._guards.values() if g.deadline <= now]
            if expired:
                self.fire(min(expired, key=lambda g: g.deadline))
                return

    def fire(self, g: _Guard) -> None:
        """Log and record ``g``'s incident, then end the process."""
        inc = incident(g.what, g.on, waited_s=time.monotonic() - g.t0, limit_s=g.limit_s, field=g.field,
                       action=g.action, source=self.source, stack=thread_stack(g.thread))
        log.critical("%s\n%s", message(inc), inc.stack)
        if self.sink is not None:
            try:
                self.sink.append(inc)
            except Exception as e:  # noqa: BLE001  exiting matters more than the record
                log.critical("could not record the incident: %r", e)
        for h in logging.getLogger().handlers + log.handlers:
            h.flush()
        sys.stderr.flush()
        self._exit(EXIT_STALLED)


# -- the incidents stream -------------------------------------------------------------------


def _fields(inc: Incident, source: str) -> dict[str, str]:
    return {"incident": inc.model_copy(update={"source": inc.source or source}).model_dump_json()}


class IncidentLog:
    """A run's incidents stream, through an async Redis client."""

    def __init__(self, redis, keys: Keys, *, source: str = "") -> None:
        self.redis = redis
        self.keys = keys
        self.source = source

    async def append(self, inc: Incident) -> None:
        await self.redis.xadd(self.keys.incidents, _fields(inc, self.source), maxlen=MAX_INCIDENTS, approximate=True)

    async def recent(self, n: int = 20) -> list[Incident]:
        """The newest ``n`` incidents, newest first (an unreadable entry is skipped)."""
        out = []
        for _id, fields in await self.redis.xrevrange(self.keys.incidents, count=n):
            raw = fields.get(b"incident") or fields.get("incident")
            try:
                out.append(Incident.model_validate_json(raw))
            except ValueError:
                log.warning("unreadable incident %s in %s", _id, self.keys.incidents)
        return out


class SyncIncidentLog:
    """The same stream, written with a blocking client of its own (connect and socket timeouts
    of a few seconds): usable from a monitor thread while the process's event loop is stuck."""

    def __init__(self, redis_url: str, keys: Keys, *, source: str = "", timeout_s: float = 3.0) -> None:
        self.redis_url = redis_url
        self.keys = keys
        self.source = source
        self.timeout_s = timeout_s

    def append(self, inc: Incident) -> None:
        import redis

        client = redis.Redis.from_url(
            self.redis_url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )
        try:
            client.xadd(self.keys.incidents, _fields(inc, self.source), maxlen=MAX_INCIDENTS, approximate=True)
        finally:
            client.close()
