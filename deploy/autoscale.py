"""The rollout autoscaler: how many rollout containers the active run can use, set on Modal.

Actors pull prompt groups from Redis, so no request ever reaches a rollout container for Modal's
own autoscaler to count: the fleet is whatever ``min_containers`` keeps running. The scheduled
function ``autoscale`` of ``deploy.modal_app`` calls :func:`tick` every
``[modal.autoscale].interval_s``: it reads the active run's backlog (:func:`read_backlog`),
decides (:func:`decide`, a pure function) and sets the rollout class's ``min_containers``
through its autoscaler (the ``apply`` it is given: ``deploy.modal_app._scale_rollout``). Its state between ticks lives in
Redis (``broker.keys.AUTOSCALER``).

The policy, per look at the run:

- *more*: prompt groups are waiting that no rollout server has taken, admission has free slots
  (``(eta + 1) * groups_per_step`` minus groups queued for the learner or being generated) and no
  group was dropped as stale since the last look: the rollout servers are the bottleneck.
- *fewer*: no active run; or nothing left to generate; or groups were dropped as stale (the
  rollout side runs too far ahead of the learner); or admission is full with at least a step's
  groups waiting for the learner (the learner is the bottleneck).
- otherwise *hold*.

Hysteresis: a container is added after ``up_after`` consecutive looks asking for more, removed
after ``down_after`` consecutive looks asking for fewer (slower: a pause between publishes must not
shrink the fleet), one at a time, and never within ``cooldown_s`` of the last change. Bounds: at
least ``[modal.rollout].min_containers``, at most ``[modal.rollout].max_containers`` and at most
the run's admission capacity (a container holds at least one admitted group, so more could not all
work). docs/modal.md describes it for users; ``tests/unit/deploy/test_autoscale.py`` replays a
recorded backlog through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace

from broker import Admission, Keys, Stream
from broker.keys import AUTOSCALER
from deploy.config import Autoscale
from services.config import RunConfig
from services.runs import RunStore

log = logging.getLogger("tandem.autoscale")


@dataclass(frozen=True)
class Backlog:
    """One look at the active run (``run_id`` None: no active run; the counts are then 0)."""

    run_id: str | None
    waiting: int = 0
    """Prompt groups no rollout server has taken yet."""
    queued: int = 0
    """Groups generated and waiting for the learner."""
    in_flight: int = 0
    """Groups admitted and being generated."""
    capacity: int = 0
    """Admission capacity, ``(max_staleness + 1) * groups_per_step``."""
    groups_per_step: int = 1
    stale_dropped: int = 0
    """Groups the learner dropped as too stale, since the run began."""

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - self.queued - self.in_flight)


@dataclass(frozen=True)
class Bounds:
    """The containers the fleet may have: ``[modal.rollout]`` min/max, the top capped by the run."""

    low: int
    high: int

    @classmethod
    def of(cls, min_containers: int, max_containers: int, backlog: Backlog) -> Bounds:
        high = max_containers if backlog.run_id is None else min(max_containers, max(1, backlog.capacity))
        return cls(min_containers, max(min_containers, high))


@dataclass(frozen=True)
class State:
    """What the autoscaler remembers between looks."""

    containers: int
    up: int = 0
    """Consecutive looks asking for more."""
    down: int = 0
    """Consecutive looks asking for fewer."""
    changed_at: float = float("-inf")
    """When the containers last changed (never: no cool-down)."""
    stale_seen: int = 0
    run_id: str = ""


@dataclass(frozen=True)
class ScalingDecision:
    containers: int
    reason: str
    changed: bool


def want(backlog: Backlog, stale_seen: int) -> str:
    """"more", "fewer" or "hold" for one look (module docstring)."""
    stale = backlog.stale_dropped > stale_seen
    if backlog.run_id is None or backlog.waiting == 0 or stale:
        return "fewer"
    if backlog.free_slots == 0 and backlog.queued >= backlog.groups_per_step:
        return "fewer"
    if backlog.free_slots > 0:
        return "more"
    return "hold"


def decide(backlog: Backlog, state: State, bounds: Bounds, policy: Autoscale, now: float) -> tuple[State, ScalingDecision]:
    """The next state and the containers to keep, from one look at the backlog."""
    if backlog.run_id != (state.run_id or None):  # a new run (or none): its stale count starts anew
        state = replace(state, run_id=backlog.run_id or "", stale_seen=0, up=0, down=0)
    wish = want(backlog, state.stale_seen)
    up = state.up + 1 if wish == "more" else 0
    down = state.down + 1 if wish == "fewer" else 0
    state = replace(state, up=up, down=down, stale_seen=backlog.stale_dropped)
    clamped = min(max(state.containers, bounds.low), bounds.high)
    if clamped != state.containers:
        state = replace(state, containers=clamped, up=0, down=0, changed_at=now)
        return state, ScalingDecision(clamped, f"bounds {bounds.low}..{bounds.high}", True)
    cooling = now - state.changed_at < policy.cooldown_s
    if up >= policy.up_after and state.containers < bounds.high and not cooling:
        state = replace(state, containers=state.containers + 1, up=0, down=0, changed_at=now)
        return state, ScalingDecision(state.containers, f"more: work waiting and admission open for {up} looks", True)
    if down >= policy.down_after and state.containers > bounds.low and not cooling:
        state = replace(state, containers=state.containers - 1, up=0, down=0, changed_at=now)
        return state, ScalingDecision(state.containers, f"fewer: {_why_fewer(backlog)} for {down} looks", True)
    return state, ScalingDecision(state.containers, f"hold ({wish}{', cooling down' if cooling else ''})", False)


def _why_fewer(backlog: Backlog) -> str:
    if backlog.run_id is None:
        return "no active run"
    if backlog.waiting == 0:
        return "nothing left to generate"
    if backlog.free_slots == 0:
        return "admission full, the learner is behind"
    return "groups dropped as stale"


async def read_backlog(redis) -> Backlog:
    """The active run's backlog, from the keys the control plane, rollout servers and learner keep."""
    record = await RunStore(redis).active()
    if record is None:
        return Backlog(run_id=None)
    config = RunConfig.model_validate(record.config)
    keys = Keys(record.run_id)
    admission = Admission(redis, keys, max_staleness=config.staleness.max_staleness,
                          groups_per_step=config.learner.groups_per_step)
    counts = await admission.counts()
    prompts = Stream.prompts(redis, keys)
    stale = await redis.hget(keys.counters, "stale_dropped")
    return Backlog(
        run_id=record.run_id, waiting=max(0, await prompts.backlog() - await prompts.pending()),
        queued=counts["queued"], in_flight=counts["in_flight"], capacity=admission.capacity,
        groups_per_step=config.learner.groups_per_step, stale_dropped=int(stale or 0),
    )


async def load_state(redis, default: int) -> State:
    raw = {k.decode(): v.decode() for k, v in (await redis.hgetall(AUTOSCALER)).items()}
    if not raw:
        return State(containers=default)
    return State(containers=int(raw["containers"]), up=int(raw["up"]), down=int(raw["down"]),
                 changed_at=float(raw["changed_at"]), stale_seen=int(raw["stale_seen"]), run_id=raw["run_id"])


async def tick(redis, *, min_containers: int, max_containers: int, policy: Autoscale,
               apply: Callable[..., Awaitable[object]], now: float | None = None) -> ScalingDecision:
    """One look: read, decide, ``apply(min_containers=N, max_containers=M)`` (every look: a redeploy
    resets Modal's autoscaler to the decorator's values), remember."""
    now = time.time() if now is None else now
    backlog = await read_backlog(redis)
    state = await load_state(redis, default=min_containers)
    state, decision = decide(backlog, state, Bounds.of(min_containers, max_containers, backlog), policy, now)
    await apply(min_containers=decision.containers, max_containers=max(max_containers, decision.containers))
    await redis.hset(AUTOSCALER, mapping={k: str(v) for k, v in asdict(state).items()})
    (log.info if decision.changed else log.debug)("rollout containers %d: %s (%s)", decision.containers,
                                                    decision.reason, backlog)
    return decision
