"""Where the pipeline's bubbles are: the steady state's busy and idle seconds of each side, by reason.

    .venv/bin/python bench/bubbles.py TRACE [--skip 0.1] [--json]

``TRACE`` is what ``tandem trace RUN -o trace.json`` wrote (trace-event JSON), a run directory's
``timeline.jsonl``, or the run directory itself (docs/trace.md). The first ``--skip`` share of the learner's
steps (start-up: engines warming, the "before" evaluation) is left out; the steady state runs from the end
of the last skipped step to the end of the last step.

Rollout server (summed over servers; each instant counted once, for the first line that covers it):

- ``generate``: at least one training group generating;
- ``eval``: held-out prompts generating (``eval_hold``), no training group;
- idle, by reason: ``reload`` (loading a version, nothing generating), ``stale`` (admission
  refused the loaded version), ``full`` (waiting for room under admission's capacity: an ``admit`` span that
  ended ``full``, or ``admitted`` after waiting; its first Redis round trip is counted too), ``score``
  (groups waiting for the reward server, none generating), ``handoff`` (handing groups to the learner), and
  ``other`` (none of these: the admission loop between attempts, reading prompts).

``busy`` = generate + eval. It also prints the mean number of training groups generating at once (vLLM
batches them; a server that is busy with one group at a time is busy but slow).

Learner: ``busy`` (its step, publish and checkpoint) and ``data wait`` (its ``read`` span). ``both idle`` is
the time the learner waited for data while no rollout server generated: a bubble of the pipeline itself,
not of either side's speed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from services.timeline import TIMELINE_FILE, Span, breakdown, exclusive, read_file  # noqa: E402

ROLLOUT_ORDER = ("generate", "eval", "reload", "stale", "full", "score", "handoff", "other")
"""Each instant of a rollout server's life goes to the first of these that covers it."""
ROLLOUT_BUSY = ("generate", "eval")


def load(path: Path) -> list[Span]:
    """The spans of a trace-event JSON file (``tandem trace``), a ``timeline.jsonl`` or a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / TIMELINE_FILE
    if path.suffix == ".jsonl":
        return read_file(path)
    doc = json.loads(path.read_text())
    t0 = float(doc.get("otherData", {}).get("t0_unix_s", 0.0))
    events = doc["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): re.sub(r" #\d+$", "", e["args"]["name"])
              for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return [Span(e["name"], process[e["pid"]], thread.get((e["pid"], e["tid"]), ""), t0 + e["ts"] / 1e6,
                 t0 + (e["ts"] + e["dur"]) / 1e6, e.get("args") or {}) for e in events if e["ph"] == "X"]


def _kind(s: Span) -> str | None:
    if s.name == "admit":  # one attempt at a slot; admission retries within it while the run is full
        return "stale" if s.attrs.get("reason") == "stale" else "full"
    if s.name == "eval_hold":
        return "eval"
    if s.name in ("reload", "broadcast"):
        return "reload"
    return s.name if s.name in ROLLOUT_ORDER else None


def _covered(intervals: list[tuple[float, float]], w0: float, w1: float) -> tuple[float, float]:
    """(seconds covered by at least one interval, integral of how many are open) over [w0, w1]."""
    events = sorted(e for a, b in intervals if min(b, w1) > max(a, w0)
                    for e in ((max(a, w0), 1), (min(b, w1), -1)))
    covered = area = 0.0
    n, t = 0, w0
    for at, d in events:
        if n > 0:
            covered += at - t
        area += n * (at - t)
        n, t = n + d, at
    return covered, area


def bubbles(spans: list[Span], skip: float = 0.1) -> dict:
    """The steady state's figures (module docstring) as a dict."""
    steps = breakdown(spans)
    if len(steps) < 2:
        raise ValueError(f"{len(steps)} learner steps in the trace: nothing to measure")
    k = min(int(len(steps) * skip), len(steps) - 1)
    w0, w1 = steps[k]["t0"], steps[-1]["t1"]
    wall = w1 - w0
    learner_read = sum(s["learner"]["read"] for s in steps[k:])
    servers: dict[str, list[Span]] = {}
    for s in spans:
        if s.service.startswith("rollout:"):
            servers.setdefault(s.service, []).append(s)
    roll = dict.fromkeys(ROLLOUT_ORDER, 0.0)
    alive = area = 0.0
    for own in servers.values():
        a, b = max(w0, min(s.start for s in own)), min(w1, max(s.end for s in own))
        if b <= a:
            continue
        alive += b - a
        for kind, secs in exclusive([(s.start, s.end, kind) for s in own if (kind := _kind(s))], a, b,
                                    ROLLOUT_ORDER).items():
            roll[kind] += secs
        area += _covered([(s.start, s.end) for s in own if s.name == "generate"], a, b)[1]
    busy = sum(roll[k] for k in ROLLOUT_BUSY)
    reads = [(s.start, s.end, "read") for s in spans if s.service == "learner" and s.name == "read"]
    working = [(s.start, s.end, "working") for s in spans
               if s.service.startswith("rollout:") and s.name in ("generate", "eval_hold")]
    both_idle = exclusive(working + reads, w0, w1, ("working", "read", "rest"))["read"]
    return {
        "steps": [steps[k]["step"], steps[-1]["step"]],
        "wall_s": wall,
        "s_per_step": wall / (len(steps) - k),
        "learner": {"busy_s": wall - learner_read, "data_wait_s": learner_read,
                    "busy": (wall - learner_read) / wall, "both_idle_s": both_idle},
        "rollout": {"servers": len(servers), "alive_s": alive, "busy_s": busy, "busy": busy / alive if alive else 0.0,
                    "by_reason_s": roll,
                    "mean_groups_generating": area / alive if alive else 0.0},
    }


def report(b: dict) -> str:
    r, ln = b["rollout"], b["learner"]
    alive = r["alive_s"] or 1.0
    lines = [
        f"steady state: steps {b['steps'][0]}..{b['steps'][1]}, {b['wall_s']:.1f} s, {b['s_per_step']:.3f} s/step",
        f"rollout ({r['servers']} server{'s' * (r['servers'] != 1)}): busy {100 * r['busy']:.1f}% of "
        f"{r['alive_s']:.1f} s; mean training groups generating at once {r['mean_groups_generating']:.1f}",
    ]
    for kind in ROLLOUT_ORDER:
        tag = "busy" if kind in ROLLOUT_BUSY else "idle"
        lines.append(f"  {tag:4} {kind:9} {r['by_reason_s'][kind]:8.2f} s  {100 * r['by_reason_s'][kind] / alive:5.1f}%")
    lines.append(f"learner: busy {100 * ln['busy']:.1f}%; data wait {ln['data_wait_s']:.2f} s "
                 f"({100 * ln['data_wait_s'] / b['wall_s']:.1f}%), of which both idle (no rollout server generating) "
                 f"{ln['both_idle_s']:.2f} s ({100 * ln['both_idle_s'] / b['wall_s']:.1f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="trace.json (tandem trace), timeline.jsonl or a run directory")
    p.add_argument("--skip", type=float, default=0.1, help="share of the first learner steps left out")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    b = bubbles(load(args.trace), args.skip)
    print(json.dumps(b, indent=2) if args.json else report(b))


if __name__ == "__main__":
    main()
