"""``tandem audit``: check a run's ledger (``broker.ledger``) and say whether it trained on exactly what it should.

The checks, each a violation when it fails:

- every group the control plane queued was queued once, and every group the
  ledger mentions was queued;
- once the run is closed, every queued group ended exactly once: trained, or
  dropped with a reason (a group with no end is *lost*); before that, at most
  once (the rest are reported as open);
- no group was trained twice, nor both trained and dropped;
- every trained group was generated, by the version it was trained as (with
  in-flight reloads, ``publish.reload = "keep"``, the oldest version that sampled
  one of its tokens: the rollout server records them all), and
  within ``eta`` of the step that used it: ``0 <= lag(basis, version) <= eta``
  with retracted versions not counted (``broker.admission.lag``), and never
  from a retracted version;
- no step trained more groups than ``learner.groups_per_step``, and, in a
  finished run, every step up to its last trained some (a step whose groups
  were trained into a checkpoint but never acknowledged is training lost);
- weight versions were published contiguously (each one more than the
  last, none twice; a number skipped only if it was broadcast in memory
  and then retracted: a learner that died between a broadcast and the
  version's files), every retracted version was published or broadcast, and every
  version a rollout server loaded was published with the sha256 it loaded,
  and not loaded after it was retracted.

Reported as well: groups by outcome and drop reason, learner (re)starts,
steps lost to crashes, retracted versions, the largest lag, and the trained
groups that were multi-turn episodes (docs/episodes.md) with their model
turns and tool calls (from their ``generated`` entries). Light module (no
Redis client needed to audit a file).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from broker.admission import lag
from broker.ledger import LEDGER_FILE, read_file

TERMINAL = ("trained", "dropped")
EPISODE_FIELDS = ("turns", "tool_calls", "tool_errors")
"""What a ``generated`` entry of an episode group sums over its samples (``rollout_server.actor``)."""
MAX_LISTED = 20


@dataclass
class Audit:
    """The verdict and what it rests on (``as_dict`` is what summary.json and ``--json`` show)."""

    violations: list[str] = field(default_factory=list)
    closed: str | None = None
    """Why the run ended (``run_finished``, ...); None while it is live."""
    queued: int = 0
    trained: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    generated_by: Counter[str] = field(default_factory=Counter)
    """Groups handed off, by rollout server."""
    open: int = 0
    lost: int = 0
    trained_twice: int = 0
    starts: int = 0
    lost_steps: int = 0
    steps: int = 0
    published: list[int] = field(default_factory=list)
    retracted: list[int] = field(default_factory=list)
    loads_checked: int = 0
    max_lag: int | None = None
    max_staleness: int | None = None
    episodes: Counter[str] = field(default_factory=Counter)
    """Over the trained groups that were episodes: ``groups``, and their samples' ``turns``, ``tool_calls``
    and ``tool_errors`` (summed)."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def violate(self, message: str) -> None:
        self.violations.append(message)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "violations": len(self.violations), "first_violations": self.violations[:MAX_LISTED],
            "closed": self.closed, "groups": {"queued": self.queued, "trained": self.trained,
                                              "dropped": sum(self.dropped.values()), "open": self.open},
            "dropped_by_reason": dict(sorted(self.dropped.items())),
            "generated_by": dict(sorted(self.generated_by.items())),
            "lost": self.lost, "trained_twice": self.trained_twice, "steps": self.steps,
            "learner_starts": self.starts, "lost_steps": self.lost_steps,
            "versions": {"published": len(self.published), "last": self.published[-1] if self.published else None,
                         "retracted": self.retracted, "loads_checked": self.loads_checked},
            "max_lag": self.max_lag, "max_staleness": self.max_staleness,
            "episodes": {k: self.episodes[k] for k in ("groups", *EPISODE_FIELDS)},
        }


def audit(entries: list[dict]) -> Audit:
    """Check ``entries`` (oldest first, as ``Ledger.read`` or ``read_file`` return them)."""
    a = Audit()
    queued: Counter[str] = Counter()
    ends: dict[str, list[dict]] = defaultdict(list)
    generated: dict[str, dict] = {}
    sha: dict[int, str] = {}
    retracted: set[int] = set()
    announced: set[int] = set()  # versions broadcast in memory (publish.transport = "broadcast")
    per_step: Counter[int] = Counter()
    eta = groups_per_step = finished_steps = None
    for e in entries:
        kind, gid, d = e["e"], e["g"], e["d"]
        if kind == "queued":
            queued[gid] += 1
        elif kind == "started":
            a.starts += 1
            a.lost_steps += d.get("lost_steps", 0)
            eta, groups_per_step = d.get("max_staleness"), d.get("groups_per_step")
            a.max_staleness = eta
        elif kind == "generated":
            generated[gid] = d
            a.generated_by[d.get("server", "?")] += 1
        elif kind in TERMINAL:
            ends[gid].append(e)
            if kind == "trained":
                _check_trained(a, gid, d, generated.get(gid), eta, retracted)
                per_step[d["step"]] += 1
                _count_episodes(a, generated.get(gid))
        elif kind == "broadcast":  # announced: a server may hold it in memory before its files are published
            announced.add(d["version"])
        elif kind == "published":
            v = d["version"]
            skipped = set(range(a.published[-1] + 1, v)) if a.published else set()
            if v in sha:
                a.violate(f"version {v} published twice")
            elif a.published and (v <= a.published[-1] or not skipped <= (retracted & announced)):
                a.violate(f"version {v} published after {a.published[-1]}: not contiguous")
            sha[v] = d["sha256"]
            a.published.append(v)
        elif kind == "retracted":
            for v in d["versions"]:
                if v not in sha and v not in announced:
                    a.violate(f"version {v} retracted but never published")
            retracted.update(d["versions"])
        elif kind == "loaded":
            v = d["version"]
            a.loads_checked += 1
            if v not in sha:
                a.violate(f"{d.get('server')} loaded version {v}, which was never published")
            elif d["sha256"] != sha[v]:
                a.violate(f"{d.get('server')} loaded version {v} with sha256 {d['sha256'][:12]}, "
                          f"published as {sha[v][:12]}")
            elif v in retracted:
                a.violate(f"{d.get('server')} loaded version {v} after it was retracted")
        elif kind == "closed":
            a.closed = d.get("reason", "closed")
            finished_steps = d.get("steps")
        if gid and kind not in ("queued", "closed") and gid not in queued:
            a.violate(f"group {gid}: {kind} but never queued")
    a.queued = len(queued)
    a.retracted = sorted(retracted)
    a.steps = max(per_step, default=0)
    for gid, n in queued.items():
        if n > 1:
            a.violate(f"group {gid} queued {n} times")
    for gid in queued:
        got = ends.get(gid, [])
        kinds = [x["e"] for x in got]
        a.trained += kinds.count("trained")
        for x in got:
            if x["e"] == "dropped":
                a.dropped[x["d"].get("reason", "unknown")] += 1
        if kinds.count("trained") > 1:
            a.trained_twice += 1
            a.violate(f"group {gid} trained {kinds.count('trained')} times")
        if len(got) > 1 and kinds.count("trained") <= 1:
            a.violate(f"group {gid} ended {len(got)} times: {', '.join(_outcome(x) for x in got)}")
        if not got:
            a.open += 1
    if a.closed is not None and a.open:
        a.lost = a.open
        a.violate(f"{a.open} queued groups never ended (lost) although the run was closed ({a.closed})")
    if groups_per_step:
        for step, n in sorted(per_step.items()):
            if n > groups_per_step:
                a.violate(f"step {step} trained {n} groups (groups_per_step {groups_per_step})")
    if finished_steps:
        untrained = [s for s in range(1, finished_steps + 1) if not per_step[s]]
        if untrained:
            a.violate(f"the run finished {finished_steps} steps, but these trained no group: {_ranges(untrained)}")
    return a


def _count_episodes(a: Audit, gen: dict | None) -> None:
    if gen is not None and "turns" in gen:
        a.episodes["groups"] += 1
        a.episodes.update({k: gen.get(k, 0) for k in EPISODE_FIELDS})


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None], strict=True):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return ", ".join(out)


def _check_trained(a: Audit, gid: str, d: dict, gen: dict | None, eta: int | None, retracted: set[int]) -> None:
    if gen is None:
        a.violate(f"group {gid} trained at step {d['step']} but never generated")
        return
    if gen["version"] != d["version"]:
        a.violate(f"group {gid} generated by version {gen['version']} but trained as version {d['version']}")
    if gen.get("versions") and min(gen["versions"]) != gen["version"]:  # samples spanning versions: the oldest
        a.violate(f"group {gid} tagged version {gen['version']} but its tokens were sampled by versions "
                  f"{gen['versions']}: a group is as old as its oldest token")
    if d["version"] in retracted:
        a.violate(f"group {gid} trained at step {d['step']} from retracted version {d['version']}")
    k = lag(d["basis"], d["version"], retracted)
    a.max_lag = k if a.max_lag is None else max(a.max_lag, k)
    if eta is not None and not 0 <= k <= eta:
        a.violate(f"group {gid} trained at step {d['step']} with lag {k} (version {d['version']} against "
                  f"{d['basis']}; max_staleness {eta})")


def _outcome(e: dict) -> str:
    return "trained" if e["e"] == "trained" else f"dropped ({e['d'].get('reason')})"


def find_ledger(path: Path) -> Path:
    """``path`` itself, its ``ledger.jsonl``, or the one ``ledger.jsonl`` one level below (a ``tandem run``
    directory holds the run's files under ``<run_id>/``)."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / LEDGER_FILE).is_file():
        return path / LEDGER_FILE
    found = sorted(path.glob(f"*/{LEDGER_FILE}"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{path}: no {LEDGER_FILE} here or one level below (is the run finished?)")
    raise FileNotFoundError(f"{path}: several ledgers ({', '.join(str(f) for f in found)}); name one")


def audit_file(path: Path) -> Audit:
    return audit(read_file(find_ledger(path)))
