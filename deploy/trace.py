"""``tandem trace RUN``: the run's timeline as a Chrome/Perfetto trace (trace-event JSON).

Open the file in https://ui.perfetto.dev or chrome://tracing. One process per
service (``control``, ``learner``, ``rollout:<server id>``), one thread per
track inside it (``rank0``, ``admit``, ``groups``, ``weights``, ``eval``,
``stalled``). Spans that overlap on one track without nesting (the groups a
rollout server generates at once) are spread over lanes ``groups #1``,
``groups #2``, ...; spans nested in another (``forward`` inside ``step``)
stay on its lane. Incidents are instant events on their service. The stack's
CPU account (``deploy.cpu_account``) is a counter, ``CPU cores``, on the
``stack`` process: the cores each service used over each interval. Times are
microseconds since the run's first span; each event's ``args`` hold the
span's attributes (group id, version, reason, step).

Where the spans come from: a run directory's ``timeline.jsonl`` (written by
the main job when the run ends; ``summary.json``'s incidents with it), or a
live run's Redis stream (the running stack's ``stack.json`` names Redis, as
for ``tandem audit``), so a running run can be traced as it goes.
docs/trace.md says how to read it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from services.timeline import TIMELINE_FILE, Span, read_file
from services.wire import Incident

SERVICE_ORDER = ("control", "learner")
"""Services listed first in the trace; rollout servers follow by name."""


def lanes(spans: list[Span]) -> list[int]:
    """A lane number per span (same order) such that spans on one lane follow each other or nest in a
    span of another name (``forward`` in ``step``), never partly overlap, and a span never sits inside
    one of its own name (two groups' ``generate``): greedy over spans sorted by start, longer first."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end))
    stacks: list[list[Span]] = []  # per lane: the spans still open, innermost last
    out = [0] * len(spans)
    for i in order:
        s = spans[i]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1].end <= s.start:
                stack.pop()
            if not stack or (stack[-1].end >= s.end and all(p.name != s.name for p in stack)):
                stack.append(s)
                out[i] = lane
                break
        else:
            stacks.append([s])
            out[i] = len(stacks) - 1
    return out


def _service_key(name: str) -> tuple:
    return (SERVICE_ORDER.index(name) if name in SERVICE_ORDER else len(SERVICE_ORDER), name)


def trace_events(spans: list[Span], incidents: list[Incident] = ()) -> dict:
    """The trace-event JSON object (``{"traceEvents": [...], "displayTimeUnit": "ms"}``)."""
    counters = [s for s in spans if s.name == "cpu" and s.track == "cpu"]
    spans = [s for s in spans if not (s.name == "cpu" and s.track == "cpu")]
    starts = [s.start for s in spans + counters] + [i.at for i in incidents]
    t0 = min(starts) if starts else 0.0
    services = sorted({s.service for s in spans + counters} | {i.source for i in incidents}, key=_service_key)
    pid = {name: n + 1 for n, name in enumerate(services)}
    events: list[dict] = []
    for name in services:
        events.append({"ph": "M", "name": "process_name", "pid": pid[name], "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid[name], "tid": 0,
                       "args": {"sort_index": pid[name]}})
    by_track: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for s in spans:
        by_track[(s.service, s.track)].append(s)
    tid = 0
    for (service, track), group in sorted(by_track.items(), key=lambda kv: (_service_key(kv[0][0]), kv[0][1])):
        lane_of = lanes(group)
        tids = {}
        for lane in sorted(set(lane_of)):
            tid += 1
            tids[lane] = tid
            label = track or "main"
            if len(set(lane_of)) > 1:
                label += f" #{lane + 1}"
            events.append({"ph": "M", "name": "thread_name", "pid": pid[service], "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid[service], "tid": tid,
                           "args": {"sort_index": tid}})
        for s, lane in zip(group, lane_of, strict=True):
            events.append({"ph": "X", "name": s.name, "cat": s.service.split(":")[0], "pid": pid[service],
                           "tid": tids[lane], "ts": round((s.start - t0) * 1e6, 1),
                           "dur": round(max(0.0, s.end - s.start) * 1e6, 1), "args": s.attrs})
    for c in counters:  # the stack's CPU account: cores in use per service over each interval
        width = max(1e-6, c.end - c.start)
        events.append({"ph": "C", "name": "CPU cores", "pid": pid[c.service], "tid": 0,
                       "ts": round((c.start - t0) * 1e6, 1),
                       "args": {service: round(float(sec) / width, 3) for service, sec in sorted(c.attrs.items())}})
    for inc in incidents:
        events.append({"ph": "i", "s": "p", "name": f"incident: {inc.what}"[:200], "cat": "incident",
                       "pid": pid[inc.source], "tid": 0, "ts": round((inc.at - t0) * 1e6, 1),
                       "args": {"on": inc.on, "waited_s": inc.waited_s, "limit_s": inc.limit_s,
                                "field": inc.field, "action": inc.action}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0_unix_s": t0}}


def from_run_dir(run_dir: Path) -> tuple[list[Span], list[Incident]]:
    """The spans and incidents a finished run's directory holds; FileNotFoundError without a timeline."""
    run_dir = Path(run_dir)
    found = [run_dir / TIMELINE_FILE, *sorted(run_dir.glob(f"*/{TIMELINE_FILE}"))]
    path = next((p for p in found if p.exists()), None)
    if path is None:
        raise FileNotFoundError(f"{run_dir} holds no {TIMELINE_FILE} (a run of `tandem run` writes it when it ends; "
                                "trace a running run by its id)")
    incidents: list[Incident] = []
    summary = path.parent / "summary.json"
    if summary.exists():
        incidents = [Incident.model_validate(i) for i in json.loads(summary.read_text()).get("incidents", [])]
    return read_file(path), incidents


async def from_redis(redis, run_id: str) -> tuple[list[Span], list[Incident]]:
    """The spans and incidents of a run in Redis (running or not yet cleaned up)."""
    from broker.keys import Keys
    from services import timeline
    from services.watchdog import MAX_INCIDENTS, IncidentLog

    keys = Keys(run_id)
    incidents = await IncidentLog(redis, keys).recent(MAX_INCIDENTS)
    return await timeline.read(redis, keys), incidents[::-1]


def write(path: Path, spans: list[Span], incidents: list[Incident] = ()) -> dict:
    """Write the trace to ``path``; returns it."""
    trace = trace_events(spans, list(incidents))
    Path(path).write_text(json.dumps(trace, separators=(",", ":")))
    return trace
