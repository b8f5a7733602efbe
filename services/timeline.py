"""The run's timeline: spans of work and waiting, from every service, on the run's clock.

Who writes: each service records spans of its own work and waits in a
:class:`Timeline` (the rollout server's actor: admission, generation,
scoring, hand-off, reloads, held-out generation; the learner's rank 0: the
data read, the step with its forward, backward and optimizer parts, publish,
checkpoint; the control plane: the stalls it saw, :mod:`control_plane.stalls`).
Who reads: ``tandem trace`` (:mod:`deploy.trace`, a Chrome/Perfetto trace),
the dashboard's per-step breakdown, and the main job, which saves the
spans to ``timeline.jsonl`` in the run directory.

A span is (name, service, track, start, end, attributes). ``start`` and
``end`` are Unix seconds (``time.time()``): the clock the ledger's stream ids
and the metric points use, so spans, ledger entries and incidents line up.
``service`` is who recorded it (``learner``, ``rollout:<server id>``,
``control``); ``track`` is the lane inside it (``rank0``, ``admit``,
``groups``, ``weights``, ``eval``). Spans of one kind on one sequential track
never overlap (a group's spans on ``groups`` do: groups run concurrently).

Cost: recording is a ``deque.append`` of a small tuple; a daemon thread with
its own Redis connection writes the buffer every ``flush_s`` in one pipelined
round trip (``XADD ... MAXLEN ~``), so neither an event loop nor a blocked
training step waits on Redis for it. ``bench/timeline.py`` measures both
sides; docs/trace.md quotes the figures.

Storage: one Redis stream per run (``Keys.timeline``), trimmed to about
:data:`MAXLEN` entries (the oldest go first: a long run keeps its latest
stretch). Entry fields: ``n`` name, ``s`` service, ``k`` track, ``t0``/``t1``
(Unix seconds), ``a`` (JSON attributes).

Heartbeat: the same thread writes ``service -> now`` into ``Keys.heartbeats``
every ``flush_s``, and removes the field when the recorder stops. A process
that stops (SIGSTOP, swapped out, hung in C code holding the GIL) stops
beating; the control plane records the silence as an incident
(:mod:`control_plane.stalls`). A long training step does not: the thread
beats while the step runs.

Light module: no torch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from broker.keys import Keys

log = logging.getLogger("tandem.timeline")

MAXLEN = 200_000
"""Spans kept per run, about (``XADD MAXLEN ~``): some 40 MB of Redis at most; the example's
150 steps write about 12,000."""
FLUSH_S = 0.5
"""How often the recorder's thread writes its buffer and its heartbeat."""
BUFFER = 100_000
"""Spans held in memory while Redis is unreachable; past it the oldest are dropped (and counted)."""
TIMELINE_FILE = "timeline.jsonl"
"""The spans of a finished run, in its run directory (one JSON object per line)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One interval of work or waiting. ``start <= end``, Unix seconds."""

    name: str
    service: str
    track: str
    start: float
    end: float
    attrs: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "service": self.service, "track": self.track,
                "start": self.start, "end": self.end, "attrs": self.attrs}

    @classmethod
    def from_dict(cls, d: dict) -> Span:
        return cls(d["name"], d["service"], d["track"], float(d["start"]), float(d["end"]), d.get("attrs") or {})

    def fields(self) -> dict[str, str]:
        """The stream entry."""
        return {"n": self.name, "s": self.service, "k": self.track, "t0": repr(self.start), "t1": repr(self.end),
                "a": json.dumps(self.attrs, separators=(",", ":"), default=str)}

    @classmethod
    def from_fields(cls, f: dict) -> Span:
        g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in f.items()}
        return cls(g["n"], g["s"], g.get("k", ""), float(g["t0"]), float(g["t1"]), json.loads(g.get("a") or "{}"))


class Timeline:
    """One service's span recorder for one run. ``start()`` it, record with :meth:`span` or
    :meth:`add` from any thread, ``stop()`` it (a last flush; the heartbeat field removed).

    Without a Redis URL (``Timeline.off()``) it records nothing and costs a function call."""

    def __init__(self, redis_url: str | None, keys: Keys | None, service: str, *,
                 flush_s: float = FLUSH_S, maxlen: int = MAXLEN) -> None:
        self.redis_url = redis_url
        self.keys = keys
        self.service = service
        self.flush_s = flush_s
        self.maxlen = maxlen
        self.enabled = bool(redis_url) and keys is not None
        self._buf: deque[Span] = deque()
        self.dropped = 0
        self.written = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = None

    @classmethod
    def off(cls) -> Timeline:
        """A recorder that records nothing (a service without a run, a test of one part)."""
        return cls(None, None, "")

    # -- recording ------------------------------------------------------------

    def add(self, name: str, start: float, end: float, track: str = "", **attrs) -> None:
        """Record a span that has ended. Safe from any thread."""
        if not self.enabled:
            return
        if len(self._buf) >= BUFFER:
            self._buf.popleft()
            self.dropped += 1
        self._buf.append(Span(name, self.service, track, start, end, attrs))

    @contextmanager
    def span(self, name: str, track: str = "", **attrs) -> Iterator[dict]:
        """``with timeline.span("generate", "groups", group=gid) as a: ...``: the span of the block;
        ``a`` takes attributes known only inside it (``a["reason"] = ...``). A block that raises
        is recorded with ``error`` set to the exception's type."""
        if not self.enabled:
            yield attrs
            return
        t0 = time.time()
        try:
            yield attrs
        except BaseException as e:
            attrs["error"] = type(e).__name__
            raise
        finally:
            self.add(name, t0, time.time(), track, **attrs)

    # -- writing --------------------------------------------------------------

    def start(self) -> Timeline:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"timeline-{self.service}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is buffered, remove the heartbeat, end the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None

    async def stop_async(self) -> None:
        """:meth:`stop` from an event loop (its join waits in a thread)."""
        import asyncio

        await asyncio.to_thread(self.stop)

    def _connect(self):
        import redis

        if self._client is None:
            self._client = redis.Redis.from_url(self.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
        return self._client

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.flush_s):
                self._flush_logged(beat=True)
            self._flush_logged(beat=False)
        finally:
            if self._client is not None:
                self._client.close()

    def _flush_logged(self, *, beat: bool) -> None:
        try:
            self.flush(beat=beat)
        except Exception as e:  # noqa: BLE001  Redis away: the spans stay buffered, the service goes on
            log.warning("timeline of %s: could not write %d spans: %r", self.service, len(self._buf), e)
            self._client = None

    def flush(self, *, beat: bool = True) -> int:
        """Write the buffered spans (and the heartbeat, or its removal when ``beat`` is false) in one
        round trip; returns how many spans. Called by the thread; callable directly (tests)."""
        if not self.enabled:
            return 0
        spans = []
        while self._buf:
            spans.append(self._buf.popleft())
        pipe = self._connect().pipeline(transaction=False)
        for s in spans:
            pipe.xadd(self.keys.timeline, s.fields(), maxlen=self.maxlen, approximate=True)
        if beat:
            pipe.hset(self.keys.heartbeats, self.service, repr(time.time()))
        else:
            pipe.hdel(self.keys.heartbeats, self.service)
        try:
            pipe.execute()
        except Exception:
            self._buf.extendleft(reversed(spans))  # written next time
            raise
        self.written += len(spans)
        return len(spans)


# -- reading ------------------------------------------------------------------


async def append(redis, keys: Keys, spans: list[Span], maxlen: int = MAXLEN) -> None:
    """Add spans through an async client (the control plane's stall spans)."""
    if spans:
        pipe = redis.pipeline(transaction=False)
        for s in spans:
            pipe.xadd(keys.timeline, s.fields(), maxlen=maxlen, approximate=True)
        await pipe.execute()


async def read(redis, keys: Keys, page: int = 10_000) -> list[Span]:
    """Every span of the run still kept, in the order written."""
    out: list[Span] = []
    start = "-"
    while True:
        rows = await redis.xrange(keys.timeline, min=start, count=page)
        out += [Span.from_fields(f) for _, f in rows]
        if len(rows) < page:
            return out
        start = "(" + (rows[-1][0].decode() if isinstance(rows[-1][0], bytes) else rows[-1][0])


def write_file(path: Path, spans: list[Span]) -> None:
    from host.files import write_atomic

    write_atomic(path, "".join(json.dumps(s.as_dict(), separators=(",", ":")) + "\n" for s in spans))


def read_file(path: Path) -> list[Span]:
    return [Span.from_dict(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


# -- the per-step breakdown ---------------------------------------------------

LEARNER_ACTIVITIES = ("forward", "backward", "optimizer", "step_other", "publish", "checkpoint", "other", "read")
"""The learner's seconds per step: busy by activity, then ``read`` (waiting for data: idle). ``step_other``
is the step's time outside forward, backward and optimizer; ``other`` the window's time outside every span."""
LEARNER_IDLE = frozenset({"read"})
ROLLOUT_ACTIVITIES = ("generate", "score", "handoff", "eval_hold", "reload", "full", "stale", "idle")
"""The rollout servers' seconds per step (summed over servers), each instant counted once, for the first
of these that covers it: busy generating, scoring, handing off, generating held-out prompts; idle while
reloading weights, waiting in admission for room (``full``, also an admission that got in after waiting)
or sent to load newer weights (``stale``), or otherwise (``idle``)."""
ROLLOUT_IDLE = frozenset({"reload", "full", "stale", "idle"})


def _rollout_kind(s: Span) -> str | None:
    if s.name == "admit":  # one reserve(): it waits for room, so an admission that got in may have waited too
        return "stale" if s.attrs.get("reason") == "stale" else "full"
    return s.name if s.name in ROLLOUT_ACTIVITIES else None


def exclusive(intervals: list[tuple[float, float, str]], w0: float, w1: float, order: tuple[str, ...]) -> dict:
    """Seconds of [w0, w1] per kind, each instant given to the first kind of ``order`` covering it (the last
    kind of ``order`` takes what none covers)."""
    rank = {k: i for i, k in enumerate(order)}
    events = []
    for a, b, kind in intervals:
        a, b = max(a, w0), min(b, w1)
        if b > a:
            events += [(a, 1, rank[kind]), (b, -1, rank[kind])]
    events.sort()
    out = dict.fromkeys(order, 0.0)
    open_ = [0] * len(order)
    t = w0
    for at, delta, r in events + [(w1, 0, 0)]:
        if at > t:
            first = next((i for i, n in enumerate(open_) if n > 0), len(order) - 1)
            out[order[first]] += at - t
            t = at
        open_[r] += delta
    return out


def breakdown(spans: list[Span]) -> list[dict]:
    """Per learner step: ``{"step", "t0", "t1", "learner": {activity: s}, "rollout": {activity: s}}``.

    Step ``s``'s window runs from the end of step ``s - 1``'s window (the start of its first ``read`` for
    the first step seen) to the end of its last learner span (``read``, ``step``, ``publish``,
    ``checkpoint``), so consecutive windows tile the run. Forward, backward and optimizer spans belong
    to the ``step`` span that contains them."""
    learner = [s for s in spans if s.service == "learner"]
    by_step: dict[int, list[Span]] = {}
    for s in learner:
        if s.name in ("read", "step", "publish", "checkpoint") and isinstance(s.attrs.get("step"), int):
            by_step.setdefault(s.attrs["step"], []).append(s)
    parts = [s for s in learner if s.name in ("forward", "backward", "optimizer")]
    rollout: dict[str, list[tuple[float, float, str]]] = {}
    for s in spans:
        if s.service.startswith("rollout:") and (kind := _rollout_kind(s)) is not None:
            rollout.setdefault(s.service, []).append((s.start, s.end, kind))
    lives = {server: (min(i[0] for i in iv), max(i[1] for i in iv)) for server, iv in rollout.items()}
    out: list[dict] = []
    prev_end: float | None = None
    for step in sorted(by_step):
        own = by_step[step]
        w0 = prev_end if prev_end is not None else min(s.start for s in own)
        w1 = max(s.end for s in own)
        if w1 <= w0:
            continue
        secs = dict.fromkeys(LEARNER_ACTIVITIES, 0.0)
        for s in own:
            if s.name == "step":
                inner = {k: sum(p.end - p.start for p in parts if p.name == k and s.start <= p.start and p.end <= s.end)
                         for k in ("forward", "backward", "optimizer")}
                for k, v in inner.items():
                    secs[k] += v
                secs["step_other"] += max(0.0, (s.end - s.start) - sum(inner.values()))
            else:
                secs[s.name] += max(0.0, min(s.end, w1) - max(s.start, w0))
        secs["other"] = max(0.0, (w1 - w0) - sum(secs.values()))
        roll = dict.fromkeys(ROLLOUT_ACTIVITIES, 0.0)
        for server, intervals in rollout.items():  # a server counts from its first span to its last
            a, b = max(w0, lives[server][0]), min(w1, lives[server][1])
            if b > a:
                for k, v in exclusive(intervals, a, b, ROLLOUT_ACTIVITIES).items():
                    roll[k] += v
        out.append({"step": step, "t0": w0, "t1": w1, "learner": secs, "rollout": roll})
        prev_end = w1
    return out
