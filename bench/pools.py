"""Throughput of separate rollout and learner pools, simulated from the costs one run measured.

Imported by ``bench/e2e.py``, which measures the costs on a ``tandem run``
(:func:`measure_costs`) and prints :func:`report` beside the measured figure;
``python bench/pools.py [bench/results/e2e.json]`` prints it again from a
result file.

The model is a small discrete-event simulation of docs/architecture.md section 3
and of how the services behave, with the costs as inputs (:class:`Costs`):

- **Rollout server** (one per machine, or ``cpu_share`` of one when servers
  share cores): vLLM batches the groups in flight, so with ``n`` of them each
  progresses at ``cpu_share / (lat0_s + lat1_s * (n - 1))`` per second: a lone group
  takes ``lat0_s``, and at full batching a group costs about ``lat1_s`` of the
  server's time. Up to ``concurrency`` groups at once (the actor's
  ``actor_concurrency``). It starts a group only with an admission ticket:
  fewer than ``(eta + 1) x groups_per_step`` groups queued or in flight. When a
  version is published it loads it at once, the way ``rollout_server.engine``
  does: no new group starts, the groups in flight finish on the old weights
  (the drain), then ``reload_s`` of loading. A group carries the version it
  started on. Of the groups it generates, ``signal_frac`` carry a gradient; the
  rest are dropped as zero-variance (DAPO dynamic sampling) and free their ticket.
- **Learner**: forms a step from the queue in arrival order, dropping groups with
  ``v_learner - v > eta`` (stale); with ``groups_per_step`` acceptable groups it
  trains (``train_s``), frees their tickets, then publishes (``publish_s``), as
  ``learner.trainer`` does (so a server may start a group on the old version
  during the publish; it is dropped later).

What follows: at ``eta = 0`` a step is strictly serial (reload, generation of
the step's groups, train, publish); with ``eta >= 1``, enough servers and a
version that comes back as generated groups (drain + reload + a batch's
latency) well within ``eta`` steps, the learner never waits and a step costs
``train_s + publish_s``. With ``eta = 1`` that round trip competes with one
step: only ``groups_per_step`` tickets are free while the learner trains, and
groups started in the publish window on the old version go stale a step later.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Costs:
    """Measured costs (seconds); see the module docstring."""

    lat0_s: float
    """Generation + scoring latency of a group alone on a rollout server."""
    lat1_s: float
    """Latency each further group in flight adds (a group's cost at full batching)."""
    train_s: float
    """Learner time per step apart from publishing (forward, backward, optimizer, bookkeeping)."""
    publish_s: float
    reload_s: float
    groups_per_step: int = 16
    signal_frac: float = 1.0
    concurrency: int = 32
    poll_s: float = 0.05
    """A server refused for want of a ticket asks again after this long (``Admission.reserve``)."""


@dataclass(frozen=True)
class Point:
    """One simulated configuration."""

    servers: int
    eta: int
    step_s: float
    learner_idle: float
    rollout_idle: float
    stale_frac: float
    max_lag: int
    """Largest ``v_learner - v`` among the groups trained (never above ``eta``)."""

    def samples_per_s(self, groups_per_step: int, group_size: int) -> float:
        """Trained samples per second."""
        return groups_per_step * group_size / self.step_s


class _Server:
    def __init__(self) -> None:
        self.loaded = 0
        self.state = "run"            # run | drain | reload
        self.flight: list[list] = []  # [work left (1 -> 0), version]
        self.last = 0.0
        self.busy_s = 0.0
        self.epoch = 0                # invalidates completion events scheduled before a change
        self.polling = False          # waiting for a ticket; asks again at its next poll


def simulate(costs: Costs, servers: int, eta: int, *, steps: int = 100, cpu_share: float = 1.0) -> Point:
    """Run ``steps`` optimizer steps; the step time is averaged after the first ``steps // 5``."""
    if servers < 1 or eta < 0 or steps < 5 or not 0 < cpu_share <= 1:
        raise ValueError("need servers >= 1, eta >= 0, steps >= 5, 0 < cpu_share <= 1")
    k = costs.groups_per_step
    capacity = (eta + 1) * k
    pool = [_Server() for _ in range(servers)]
    events: list[tuple[float, int, str, int, int]] = []
    seq = 0
    latest = tickets = step = stale = produced = 0
    credit = 0.0
    queue: list[int] = []  # versions of useful handed-off groups, oldest first
    learner_busy, learner_busy_s, max_lag = False, 0.0, 0
    published_at: list[float] = []

    def at(t: float, kind: str, who: int = -1, epoch: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, who, epoch))
        seq += 1

    def rate(n: int) -> float:
        return cpu_share / (costs.lat0_s + costs.lat1_s * (n - 1))

    def advance(s: _Server, now: float) -> None:
        dt = now - s.last
        if s.flight:
            r = rate(len(s.flight))
            for g in s.flight:
                g[0] -= dt * r
        if s.flight or s.state == "reload":
            s.busy_s += dt
        s.last = now

    def schedule(i: int, now: float) -> None:
        s = pool[i]
        s.epoch += 1
        if s.flight:
            left = min(g[0] for g in s.flight)
            at(now + max(left, 0.0) / rate(len(s.flight)), "generated", i, s.epoch)

    def serve(i: int, now: float) -> None:
        """Admit what the server may start now, or begin its reload once drained."""
        nonlocal tickets
        s = pool[i]
        advance(s, now)
        if s.state == "run" and s.loaded < latest:
            s.state = "drain"
        if s.state == "drain" and not s.flight:
            s.state = "reload"
            at(now + costs.reload_s, "loaded", i, latest)
        while s.state == "run" and len(s.flight) < costs.concurrency and tickets < capacity:
            tickets += 1
            s.flight.append([1.0, s.loaded])
        if s.state == "run" and len(s.flight) < costs.concurrency and not s.polling:
            s.polling = True
            at(now + costs.poll_s, "poll", i)
        schedule(i, now)

    def learn(now: float) -> None:
        nonlocal learner_busy, learner_busy_s, tickets, stale, max_lag
        if learner_busy:
            return
        fresh = [v for v in queue if latest - v <= eta]
        stale += len(queue) - len(fresh)
        tickets -= len(queue) - len(fresh)
        queue[:] = fresh
        if len(queue) >= k:
            max_lag = max([max_lag] + [latest - v for v in queue[:k]])
            del queue[:k]
            learner_busy = True
            learner_busy_s += costs.train_s + costs.publish_s
            at(now + costs.train_s, "trained")

    for i in range(servers):
        serve(i, 0.0)
    now = 0.0
    while step < steps:
        now, _, kind, who, tag = heapq.heappop(events)
        if kind == "generated":
            s = pool[who]
            if tag != s.epoch:
                continue
            advance(s, now)
            done = [g for g in s.flight if g[0] <= 1e-9]
            s.flight = [g for g in s.flight if g[0] > 1e-9]
            for g in done:
                produced += 1
                credit += costs.signal_frac
                if credit >= 1.0 - 1e-9:
                    credit -= 1.0
                    queue.append(g[1])
                else:
                    tickets -= 1  # zero-variance: acknowledged at once
            learn(now)
            serve(who, now)  # other servers see freed tickets at their next poll
        elif kind == "poll":
            pool[who].polling = False
            serve(who, now)
        elif kind == "loaded":
            s = pool[who]
            advance(s, now)
            s.loaded, s.state = tag, "run"
            serve(who, now)
        elif kind == "trained":
            tickets -= k  # held groups free their tickets before the publish (servers see them at a poll)
            at(now + costs.publish_s, "published")
        elif kind == "published":
            latest += 1
            step += 1
            published_at.append(now)
            learner_busy = False
            learn(now)
            for i in range(servers):  # each loads the new version at once
                serve(i, now)
    for s in pool:
        advance(s, now)
    warm = steps // 5
    return Point(
        servers=servers, eta=eta,
        step_s=(published_at[-1] - published_at[warm - 1]) / (steps - warm),
        learner_idle=max(0.0, 1.0 - learner_busy_s / now),
        rollout_idle=max(0.0, 1.0 - sum(s.busy_s for s in pool) / (servers * now)),
        stale_frac=stale / max(produced, 1), max_lag=max_lag,
    )


def grid(costs: Costs, servers=range(1, 9), etas=range(5), *, cpu_share: float = 1.0) -> list[Point]:
    """Every (servers, eta) pair of the pools table."""
    return [simulate(costs, n, e, cpu_share=cpu_share) for e in etas for n in servers]


def calibrate(costs: Costs, step_s: float, eta: int, *, servers: int = 1) -> tuple[Costs, float]:
    """``costs`` with both rollout latencies scaled by one factor ``k`` so that the simulated step at
    (``servers``, ``eta``) is the measured ``step_s``; returns the costs and ``k``. The latencies fitted
    from the ledger carry what the fit cannot separate (held-out evaluations sharing the engine,
    scoring, waits); one measured point fixes their scale, another checks the model."""
    def scaled(k: float) -> Costs:
        return replace(costs, lat0_s=costs.lat0_s * k, lat1_s=costs.lat1_s * k)

    lo, hi = 0.01, 100.0
    for _ in range(30):  # the simulated step grows with k
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if simulate(scaled(mid), servers, eta).step_s < step_s else (lo, mid)
    k = (lo * hi) ** 0.5
    return scaled(k), k


def table(points: list[Point], groups_per_step: int, group_size: int) -> str:
    """Trained samples/s, one row per eta, one column per rollout-server count."""
    servers = sorted({p.servers for p in points})
    etas = sorted({p.eta for p in points})
    by = {(p.servers, p.eta): p for p in points}
    lines = ["eta \\ rollout servers" + "".join(f"{n:>7}" for n in servers)]
    for e in etas:
        cells = "".join(f"{by[n, e].samples_per_s(groups_per_step, group_size):7.0f}" for n in servers)
        lines.append(f"{e:<21}{cells}")
    return "\n".join(lines)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _mean_in_flight(spans: list[tuple[float, float]]) -> list[float]:
    """For each (start, end) span, the time-averaged number of spans open during it (itself included)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    times, counts, n = [], [], 0
    for t, d in edges:
        n += d
        times.append(t)
        counts.append(n)
    out = []
    for a, b in spans:
        i = bisect.bisect_right(times, a) - 1
        total, t = 0.0, a
        while i + 1 < len(times) and times[i + 1] < b:
            total += counts[i] * (times[i + 1] - t)
            t, i = times[i + 1], i + 1
        total += counts[i] * (b - t)
        out.append(total / (b - a) if b > a else float(max(counts[i], 1)))
    return out


def measure_costs(ledger: list[dict], learner_points: list[dict], published: list[dict],
                  groups_per_step: int) -> tuple[Costs, dict]:
    """The costs of one run, from its ledger (``<run>/ledger.jsonl`` entries: ``t`` in ms, ``e``,
    ``g``, ``d``), the learner's metric points (dicts with ``t`` in s, ``tokens``,
    ``learner_tokens_per_s``, ``learner_idle_frac``) and ``learner/published.jsonl`` rows
    (``total_s``). Returns the costs and the figures they came from.

    - ``lat0_s``, ``lat1_s``: a line fitted to each group's latency (admitted -> generated)
      against the mean number of groups its server had in flight meanwhile;
    - ``train_s``: the learner's busy time per step (wall between its first and last
      points x (1 - its idle fraction), over the steps between) less ``publish_s``;
      ``forward_backward_s`` (tokens / tokens per second) is reported beside it;
    - ``reload_s``: median time from a version's ``published`` to a server's ``loaded``."""
    admitted: dict[str, tuple[str, float]] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    published_t: dict[int, float] = {}
    reloads, zero_variance = [], 0
    for row in ledger:
        t, e, d = row["t"] / 1000.0, row["e"], row.get("d", {})
        if e == "admitted":
            admitted[row["g"]] = (d.get("server", "?"), t)
        elif e == "generated" and row["g"] in admitted:
            server, t0 = admitted.pop(row["g"])
            spans.setdefault(server, []).append((t0, t))
        elif e == "published":
            published_t[d["version"]] = t
        elif e == "loaded" and d.get("version") in published_t:
            reloads.append(t - published_t[d["version"]])
        elif e == "dropped" and d.get("reason") == "zero_variance":
            zero_variance += 1
    points = sorted((p for p in learner_points if p.get("learner_tokens_per_s")), key=lambda p: p["t"])
    if not spans or len(points) < 2 or not published:
        raise ValueError("the run has no generated groups, learner steps or published versions to measure")
    bins: dict[int, list[float]] = {}
    for iv in spans.values():
        for n, (a, b) in zip(_mean_in_flight(iv), iv, strict=True):
            bins.setdefault(round(n), []).append(b - a)
    # one point per concurrency level (median latency of its groups): the few groups of a rare
    # level weigh as much as the many of a common one, so the line spans the whole range
    levels = sorted(n for n, lat in bins.items() if len(lat) >= 5) or sorted(bins)
    lat0, lat1 = _fit_line([float(n) for n in levels], [statistics.median(bins[n]) for n in levels])
    lat0 = lat0 + lat1  # the line's value at one group in flight
    generated = sum(len(lat) for lat in bins.values())
    publish_s = statistics.median(r["total_s"] for r in published)
    busy = (points[-1]["t"] - points[0]["t"]) * (1.0 - points[-1]["learner_idle_frac"]) / (len(points) - 1)
    costs = Costs(
        lat0_s=max(lat0, 1e-3), lat1_s=max(lat1, 1e-4),
        train_s=max(busy - publish_s, 1e-3), publish_s=publish_s,
        reload_s=statistics.median(reloads) if reloads else 0.0,
        groups_per_step=groups_per_step, signal_frac=1.0 - zero_variance / generated,
    )
    versions = sorted(published_t)
    cadence = [published_t[b] - published_t[a] for a, b in zip(versions, versions[1:], strict=False)]
    derived = {
        "servers": len(spans), "groups_generated": generated, "zero_variance_dropped": zero_variance,
        "forward_backward_s": statistics.median(p["tokens"] / p["learner_tokens_per_s"] for p in points),
        "learner_idle_frac": points[-1]["learner_idle_frac"], "reloads": len(reloads),
        "measured_step_s": statistics.median(cadence) if cadence else None,
    }
    return costs, derived


def report(costs: dict, step_s: float, eta: int, group_size: int, check_step_s: float | None = None,
           check_stale: int | None = None) -> tuple[str, dict]:
    """The pools table from one run's ``costs`` (:func:`measure_costs`), calibrated at its measured
    ``step_s`` (1 rollout server, ``eta``); with ``check_step_s``, the measured step with two rollout
    servers sharing one core (``cpu_share`` 0.5) beside the model's."""
    fitted = Costs(**costs)
    cal, k = calibrate(fitted, step_s, eta)
    k_steps = cal.groups_per_step
    one = simulate(cal, 1, eta)
    lines = [
        "pools model (bench/pools.py), trained samples/s; rollout servers on machines of their own, one learner;",
        "  costs from the tandem run above: " + ", ".join(f"{n} {v:.3f}" for n, v in costs.items()
                                                          if isinstance(v, float)),
        f"  rollout latencies x{k:.2f} so that the model's step at (1 server, eta {eta}) comes closest to the "
        f"measured {step_s:.3f} s",
        table(grid(cal), k_steps, group_size),
        f"measured here (1 rollout server, eta {eta}): {k_steps * group_size / step_s:.0f} samples/s (median step "
        f"{step_s:.3f} s); the model: {one.samples_per_s(k_steps, group_size):.0f} (step {one.step_s:.3f} s, "
        f"learner idle {one.learner_idle:.0%}, rollout idle {one.rollout_idle:.0%}, stale {one.stale_frac:.0%})",
    ]
    out = {"costs_fitted": costs, "scale": k, "costs": cal.__dict__, "grid": [p.__dict__ for p in grid(cal)],
           "model_1_server": one.__dict__, "measured_step_s": step_s}
    if check_step_s is not None:
        two = simulate(cal, 2, eta, cpu_share=0.5)
        lines.append(
            f"check, 2 rollout servers sharing one core (cpu_share 0.5): measured step {check_step_s:.3f} s "
            f"({k_steps * group_size / check_step_s:.0f} samples/s, stale dropped {check_stale}); model "
            f"{two.step_s:.3f} s ({two.samples_per_s(k_steps, group_size):.0f} samples/s, stale {two.stale_frac:.0%})")
        out["check"] = {"measured_step_s": check_step_s, "measured_stale_dropped": check_stale, "model": two.__dict__}
    return "\n".join(lines), out


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    result = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/e2e.json").read_text())
    example = result["sizes"]["example"]
    tandem, check = example["tandem"], example.get("pools", {}).get("check", {})
    measured = check.get("measured", {})
    text, _ = report(tandem["costs"], tandem["step_s_median"], 1, 8,
                     measured.get("step_s_median") or check.get("measured_step_s"),
                     measured.get("stale_dropped", check.get("measured_stale_dropped")))
    print(text)
