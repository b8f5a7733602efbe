"""The run registry and each run's metrics time series, in Redis.

Who talks to whom: the control plane creates runs (``POST /v1/runs``) and
stops them; the learner drives their lifecycle and, with the rollout
servers and the evaluator, appends metrics; the control plane and its
dashboard read both. Nobody calls anybody: they share these Redis keys
(names in ``broker.keys``). Light module: no torch.

Lifecycle: the states and the moves between them are :mod:`services.run_states`
(one active run per stack; ``queued`` and ``running`` are active).

How the services use it (a service started without ``TANDEM_RUN_ID``
follows the active run with one :class:`RunWatcher`)::

    store = RunStore(redis)
    runs = RunWatcher(store, poll_s=0.5)
    async for run in runs:                          # each run the control plane activates, config parsed
        await store.set_state(run.run_id, "running")    # learner, once its engine is up
        ...  # work on run.config (a RunConfig)
        await store.update(run.run_id, step=12, policy_version=12)
        await MetricsLog(redis, Keys(run.run_id)).append("learner", 12, reward_mean=0.4, kl=0.01)
        async for _ in runs.while_live(run.run_id):     # everyone: every poll_s until stopped/finished
            ...
        await store.set_state(run.run_id, "finished")   # or "failed", error="..."

The control plane has already enqueued the run's prompt groups on
``Stream.prompts(redis, Keys(run_id))`` and created the ``rollout`` and
``learner`` consumer groups when the run appears as ``queued``.
``POST /v1/runs/{id}/stop`` calls :meth:`RunStore.stop`: the run becomes
``stopped`` and services polling :meth:`RunStore.is_live` let it go.

Metric points: ``source`` is ``"learner"``, ``"rollout:<server id>"`` or
``"eval"``; ``step`` is the learner step the values belong to (a rollout
server uses the policy version it serves, an ``"eval"`` point the version it
evaluated: the learner step with ``publish.every = 1``); names are those of
:data:`METRICS` (others are stored too). ``GET /v1/runs/{id}`` reports the
latest value of each, the first ``accuracy`` and the largest ``lag_max``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from broker.keys import ACTIVE_RUN, RUNS, Keys
from broker.streams import raise_if_cancelled
from services.config import ConfigError, RunConfig, parse_run_config
from services.run_states import LIVE_STATES, STATES, TERMINAL_STATES, RunState, entered_from
from services.wire import CompletionRow, MetricPoint, RunRecord

log = logging.getLogger("tandem.runs")

METRICS: dict[str, str] = {
    "reward_mean": "mean reward of the samples trained at this step",
    "accuracy": "held-out accuracy, 0..1 (greedy unless eval.temperature > 0; mean@n with eval.samples = n > 1)",
    "held_out_reward": "mean reward of the held-out completions (the held-out score of a reward model, whose "
                       "rewards are not 0 or 1)",
    "pass_at_n": "held-out pass@n, n = eval.samples (only when n > 1; pass_at_<k> for the smaller k too)",
    "loss": "the GRPO loss of the step",
    "kl": "KL to the reference policy (k1/k3 estimate)",
    "entropy": "mean token entropy of the trained samples",
    "lag_max": "largest v_learner - v among the groups trained at this step",
    "lag_mean": "mean v_learner - v of the groups trained at this step",
    "stale_dropped": "groups dropped as too stale so far (cumulative)",
    "zero_variance_dropped": "groups dropped because all their rewards were equal, so far (cumulative)",
    "rollout_tokens_per_s": "tokens generated per second (rollout side)",
    "learner_tokens_per_s": "tokens trained per second (learner side)",
    "rollout_idle_frac": "fraction of wall time the rollout servers waited (admission)",
    "learner_idle_frac": "fraction of wall time the learner waited for trajectories",
}
"""The metric names the dashboard and the run report chart; others are kept and returned too."""

CHARTS: dict[str, tuple[str, list[str]]] = {
    "reward": ("Reward and held-out accuracy", ["reward_mean", "accuracy", "pass_at_n", "held_out_reward"]),
    "staleness": ("Staleness (policy-version lag)", ["lag_max", "lag_mean", "stale_dropped"]),
    "throughput": ("Throughput (tokens/s)", ["rollout_tokens_per_s", "learner_tokens_per_s"]),
    "idle": ("Idle fraction", ["rollout_idle_frac", "learner_idle_frac"]),
    "loss": ("Loss, KL, entropy", ["loss", "kl", "entropy"]),
}
"""Chart id -> (title, metric names vs step): the dashboard draws these, the run report should too."""

_METRIC_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_STREAM_ID = re.compile(r"^\d{1,20}(-\d{1,20})?$")
_RESERVED = frozenset({"source", "step", "t"})


class UnknownRun(KeyError):
    """No run has this id."""


class RunConflict(Exception):
    """Another run is active; ``active_id`` names it."""

    def __init__(self, active_id: str, state: str) -> None:
        super().__init__(f"run {active_id} is {state}: one run at a time; stop it first")
        self.active_id = active_id


class TransitionError(ValueError):
    """A state change the lifecycle does not allow (e.g. a finished run cannot be stopped)."""


# KEYS: state hash, active. ARGV: new state, now, error, run_id, terminal (0/1),
# the states it may be entered from (comma-separated, services.run_states.entered_from)
_SET_STATE = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {0, ''} end
if not string.find(',' .. ARGV[6] .. ',', ',' .. cur .. ',', 1, true) then return {-1, cur} end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
if ARGV[1] == 'running' and cur == 'queued' then redis.call('HSET', KEYS[1], 'started_at', ARGV[2]) end
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[2], 'error', ARGV[3])
  if redis.call('GET', KEYS[2]) == ARGV[4] then redis.call('DEL', KEYS[2]) end
end
return {1, cur}
"""

# KEYS: state hash. ARGV: field, value pairs. Updates an existing run only.
_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# ARGV (a table): maxlen, source, step, t, then name, value pairs
_APPEND_FN = """
local function append(stream, summary, a)
  local args = {'XADD', stream, 'MAXLEN', '~', a[1], '*', 'source', a[2], 'step', a[3], 't', a[4]}
  for i = 5, #a do args[#args + 1] = a[i] end
  local id = redis.call(unpack(args))
  for i = 5, #a, 2 do
    local name, v = a[i], tonumber(a[i + 1])
    redis.call('HSET', summary, 'last:' .. name, a[i + 1])
    redis.call('HSETNX', summary, 'first:' .. name, a[i + 1])
    local m = tonumber(redis.call('HGET', summary, 'max:' .. name) or '-inf')
    if v > m then redis.call('HSET', summary, 'max:' .. name, a[i + 1]) end
  end
  return id
end
"""
# KEYS: stream, summary
_APPEND = _APPEND_FN + "return append(KEYS[1], KEYS[2], ARGV)"
# KEYS: stream, summary, guard hash. ARGV: guard field, guard value, then _APPEND's
_APPEND_ONCE = _APPEND_FN + """
if redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[2]) == 0 then return false end
return append(KEYS[1], KEYS[2], {unpack(ARGV, 3)})
"""


def _state_key(run_id: str) -> str:
    try:
        return Keys(run_id).state
    except ValueError:
        raise UnknownRun(run_id) from None


def _record(raw: dict[bytes, bytes]) -> RunRecord:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    opt = lambda name: float(f[name]) if f.get(name) else None  # noqa: E731
    return RunRecord(
        run_id=f["run_id"],
        state=f["state"],
        prompt_set_id=f["prompt_set_id"],
        config=json.loads(f["config"]),
        created_at=float(f["created_at"]),
        started_at=opt("started_at"),
        finished_at=opt("finished_at"),
        error=f.get("error", ""),
        step=int(f.get("step") or 0),
        policy_version=int(f.get("policy_version") or 0),
    )


class RunStore:
    """Every run the control plane knows, and which one is active."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._set_state = redis.register_script(_SET_STATE)
        self._update = redis.register_script(_UPDATE)

    async def create(self, run_id: str, prompt_set_id: str, config: dict, owner: str | None = None) -> RunRecord:
        """Register a ``queued`` run and make it the active one, atomically; ``owner``: who created it
        (``services.security.owner_id``, kept beside the record: :meth:`owner`).

        Raises :class:`RunConflict` while another run is queued or running,
        ``ValueError`` if ``run_id`` is taken or not a valid id.
        """
        state_key = Keys(run_id).state
        record = RunRecord(
            run_id=run_id, state="queued", prompt_set_id=prompt_set_id, config=config, created_at=time.time()
        )
        fields = {
            "run_id": run_id, "state": "queued", "prompt_set_id": prompt_set_id,
            "config": json.dumps(config), "created_at": repr(record.created_at),
            "started_at": "", "finished_at": "", "error": "", "step": 0, "policy_version": 0, "owner": owner or "",
        }
        for _attempt in range(50):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(ACTIVE_RUN, state_key)
                    if await pipe.exists(state_key):
                        raise ValueError(f"run id {run_id} is taken")
                    current = await pipe.get(ACTIVE_RUN)
                    if current is not None:
                        other = current.decode()
                        other_state = await pipe.hget(Keys(other).state, "state")
                        if other_state is not None and other_state.decode() in LIVE_STATES:
                            raise RunConflict(other, other_state.decode())
                    pipe.multi()
                    pipe.set(ACTIVE_RUN, run_id)
                    pipe.hset(state_key, mapping=fields)
                    pipe.zadd(RUNS, {run_id: record.created_at})
                    await pipe.execute()
                    return record
                except WatchError:
                    continue
        raise RuntimeError("could not create the run: the registry kept changing under it")

    async def get(self, run_id: str) -> RunRecord:
        """The run's record; raises :class:`UnknownRun`."""
        raw = await self.redis.hgetall(_state_key(run_id))
        if not raw:
            raise UnknownRun(run_id)
        return _record(raw)

    async def owner(self, run_id: str) -> str | None:
        """Who created the run (:meth:`create`'s ``owner``), or None; raises :class:`UnknownRun`."""
        key = _state_key(run_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(key)
            pipe.hget(key, "owner")
            exists, owner = await pipe.execute()
        if not exists:
            raise UnknownRun(run_id)
        return owner.decode() if owner else None

    async def list(self, limit: int = 100) -> list[RunRecord]:
        """Runs, newest first."""
        ids = await self.redis.zrevrange(RUNS, 0, limit - 1)
        pipe = self.redis.pipeline(transaction=False)
        for run_id in ids:
            pipe.hgetall(Keys(run_id.decode()).state)
        return [_record(raw) for raw in await pipe.execute() if raw]

    async def active(self) -> RunRecord | None:
        """The queued or running run the stack should work on, or None."""
        current = await self.redis.get(ACTIVE_RUN)
        if current is None:
            return None
        try:
            record = await self.get(current.decode())
        except UnknownRun:
            return None
        return record if record.state in LIVE_STATES else None

    async def is_live(self, run_id: str) -> bool:
        """True while the run is queued or running: services keep working on it."""
        state = await self.redis.hget(_state_key(run_id), "state")
        return state is not None and state.decode() in LIVE_STATES

    async def set_state(self, run_id: str, state: RunState, *, error: str = "") -> RunRecord:
        """Move the run to ``state`` (along ``services.run_states.TRANSITIONS``); returns the new record.

        Entering a terminal state sets ``finished_at`` (and ``error``) and
        frees the active slot. Raises :class:`UnknownRun` or :class:`TransitionError`.
        """
        if state not in STATES:
            raise TransitionError(f"unknown state {state!r}")
        terminal = state in TERMINAL_STATES
        sources = ",".join(sorted(entered_from(state)))
        ok, previous = await self._set_state(
            keys=[_state_key(run_id), ACTIVE_RUN],
            args=[state, repr(time.time()), error[:4000] if terminal else "", run_id, "1" if terminal else "0", sources],
        )
        if ok == 0:
            raise UnknownRun(run_id)
        if ok == -1:
            raise TransitionError(f"run {run_id} is {previous.decode()}: it cannot become {state}")
        return await self.get(run_id)

    async def stop(self, run_id: str) -> RunRecord:
        """Stop a queued or running run (services polling :meth:`is_live` let go of it)."""
        return await self.set_state(run_id, "stopped")

    async def update(self, run_id: str, *, step: int | None = None, policy_version: int | None = None) -> None:
        """Record the learner's progress. Raises :class:`UnknownRun`."""
        fields: list = []
        if step is not None:
            fields += ["step", int(step)]
        if policy_version is not None:
            fields += ["policy_version", int(policy_version)]
        if fields and not await self._update(keys=[_state_key(run_id)], args=fields):
            raise UnknownRun(run_id)


@dataclass(frozen=True)
class ActiveRun:
    """A run the control plane activated, as :class:`RunWatcher` hands it out: its config validated."""

    record: RunRecord
    config: RunConfig

    @property
    def run_id(self) -> str:
        return self.record.run_id


class RunWatcher:
    """Follows the control plane's active run: the one place a service waits for runs.

    ``async for run in watcher`` yields each run that becomes active, as an
    :class:`ActiveRun`, and :meth:`while_live` ticks while that run is live;
    the service does its own work in between (see the module docstring).

    - A run is offered once per watcher: a service that is done with it, or
      gave up on it (a rollout server refusing another model), is not
      offered it again.
    - The run's config is validated here and nowhere else. A run whose
      config does not validate is never offered: whichever service sees it
      first marks it ``failed`` with the validation error as its ``error``.
    - ``stop`` (set from another thread, e.g. by an HTTP server's shutdown)
      ends both loops at the next poll; cancelling the task ends them at once.
    """

    def __init__(self, store: RunStore, *, poll_s: float = 0.5, stop: threading.Event | None = None) -> None:
        self.store = store
        self.poll_s = poll_s
        self.stop = stop
        self._offered: set[str] = set()

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def next(self) -> ActiveRun | None:
        """Wait for an active run not offered before, with a valid config; None once ``stop`` is set."""
        while not self._stopping():
            record = await self.store.active()
            raise_if_cancelled()
            if record is None or record.run_id in self._offered:
                await asyncio.sleep(self.poll_s)
                continue
            self._offered.add(record.run_id)
            try:
                config = parse_run_config(record.config, f"run {record.run_id}")
            except ConfigError as e:
                await self._refuse(record.run_id, str(e))
                continue
            return ActiveRun(record, config)
        return None

    async def __aiter__(self) -> AsyncIterator[ActiveRun]:
        while (run := await self.next()) is not None:
            yield run

    async def while_live(self, run_id: str) -> AsyncIterator[None]:
        """Tick every ``poll_s`` while the run is queued or running; return once it is not
        (finished, stopped, failed) or ``stop`` is set."""
        while not self._stopping() and await self.store.is_live(run_id):
            raise_if_cancelled()
            await asyncio.sleep(self.poll_s)
            yield

    async def _refuse(self, run_id: str, error: str) -> None:
        log.error("run %s cannot be served: %s", run_id, error)
        try:
            await self.store.set_state(run_id, "failed", error=error)
        except TransitionError:
            pass  # another service failed it first, or it was stopped meanwhile


class MetricsLog:
    """The metrics time series of one run (a capped Redis stream plus a summary hash)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, maxlen: int = 100_000) -> None:
        self.redis = redis
        self.keys = keys
        self.maxlen = maxlen
        self._append = redis.register_script(_APPEND)
        self._append_once = redis.register_script(_APPEND_ONCE)

    async def append(self, source: str, step: int, /, **values: float) -> str:
        """Add one point (``source`` e.g. "learner", "rollout:host:port", "eval"); returns its id.

        Names are lower_snake_case (see :data:`METRICS`); values must be finite.
        """
        entry_id = await self._append(keys=[self.keys.metrics, self.keys.metrics_summary],
                                      args=self._args(source, step, values))
        return entry_id.decode()

    async def append_once(self, guard: tuple[str, str, str], source: str, step: int, /, **values: float) -> str | None:
        """:meth:`append` only if field ``guard[1]`` of hash ``guard[0]`` is unset, setting it to ``guard[2]``
        in the same atomic step; None (nothing appended) if it was set. A point recorded by whichever
        of several writers comes first, once (``services.evaluate``)."""
        key, field, value = guard
        entry_id = await self._append_once(keys=[self.keys.metrics, self.keys.metrics_summary, key],
                                           args=[field, value, *self._args(source, step, values)])
        return entry_id.decode() if entry_id else None

    def _args(self, source: str, step: int, values: dict[str, float]) -> list:
        if not source or len(source) > 128:
            raise ValueError("source must be 1-128 characters")
        if step < 0:
            raise ValueError("step must be >= 0")
        args: list = [self.maxlen, source, int(step), repr(time.time())]
        for name, value in values.items():
            if not _METRIC_NAME.match(name) or name in _RESERVED:
                raise ValueError(f"bad metric name {name!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"metric {name} is not finite: {value}")
            args += [name, repr(value)]
        return args

    async def read(self, since: str | None = None, limit: int = 10_000) -> list[MetricPoint]:
        """Points after stream id ``since`` (exclusive; None = from the start), oldest first."""
        if since is not None and not _STREAM_ID.match(since):
            raise ValueError(f"since must be a stream id like 1700000000000-0, not {since!r}")
        rows = await self.redis.xrange(self.keys.metrics, min=f"({since}" if since else "-", count=limit)
        points = []
        for entry_id, fields in rows:
            f = {k.decode(): v.decode() for k, v in fields.items()}
            values = {k: float(v) for k, v in f.items() if k not in _RESERVED}
            points.append(
                MetricPoint(id=entry_id.decode(), t=float(f["t"]), source=f["source"], step=int(f["step"]), values=values)
            )
        return points

    async def summary(self) -> dict[str, dict[str, float]]:
        """``{"last": {name: v}, "first": {...}, "max": {...}}`` over every point appended."""
        raw = await self.redis.hgetall(self.keys.metrics_summary)
        out: dict[str, dict[str, float]] = {"last": {}, "first": {}, "max": {}}
        for k, v in raw.items():
            kind, _, name = k.decode().partition(":")
            out.setdefault(kind, {})[name] = float(v)
        return out


COMPLETIONS_KEPT = 10_000
"""Rows of a run's completions table kept (the newest; about 2,500 steps at ``logging.completions = 4``)."""


class CompletionsLog:
    """One run's completions table (``logging.completions``): a capped Redis stream of
    :class:`~services.wire.CompletionRow`, each entry one row as JSON, written by the learner after each step."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def append(self, rows: list[dict]) -> None:
        """Add ``rows`` (CompletionRow's fields but ``id``) in one round trip."""
        if not rows:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for row in rows:
                pipe.xadd(self.keys.completions, {"row": json.dumps(row)}, maxlen=COMPLETIONS_KEPT, approximate=True)
            await pipe.execute()

    async def read(self, since: str | None = None, limit: int = 1000) -> list[CompletionRow]:
        """Rows after stream id ``since`` (exclusive; None = from the oldest kept), oldest first."""
        if since is not None and not _STREAM_ID.match(since):
            raise ValueError(f"since must be a stream id like 1700000000000-0, not {since!r}")
        entries = await self.redis.xrange(self.keys.completions, min=f"({since}" if since else "-", count=limit)
        return [CompletionRow(id=entry_id.decode(), **json.loads(fields[b"row"])) for entry_id, fields in entries]

    async def newest(self, limit: int) -> list[CompletionRow]:
        """The newest ``limit`` rows, oldest first (the dashboard's table)."""
        entries = await self.redis.xrevrange(self.keys.completions, count=limit)
        return [CompletionRow(id=entry_id.decode(), **json.loads(fields[b"row"])) for entry_id, fields in reversed(entries)]
