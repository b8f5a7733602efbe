"""What the timeline costs: recording a span on the service's side, and writing spans to Redis.

    .venv/bin/python bench/timeline.py [--spans 200000] [--step-spans 80] [--step-s 1.2]

One embedded redis-server (AOF on, as in production). Three figures:

- *record*: the time a service spends in ``with timeline.span(...)`` (one
  attribute) and in ``timeline.add`` per span, the recorder on and its
  thread writing meanwhile, against the same block with the recorder off;
- *write*: the flushing thread's time per span (its pipelined ``XADD
  MAXLEN ~`` round trips), which runs beside the service, not in its path;
- *per step*: ``--step-spans`` spans (the example records about 6 on the
  learner and 4 per group on the rollout server, 16 groups a step: ~70) as a
  share of a ``--step-s`` step (the example's steady step on 2 cores).

Prints one table; docs/trace.md quotes a run of it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from broker import Keys  # noqa: E402
from broker.embedded import EmbeddedRedis  # noqa: E402
from services.timeline import Timeline  # noqa: E402


def per_span_us(tl: Timeline, n: int, use_with: bool) -> float:
    t0 = time.perf_counter()
    if use_with:
        for i in range(n):
            with tl.span("generate", "groups", group=i):
                pass
    else:
        for i in range(n):
            tl.add("generate", 1.0, 2.0, "groups", group=i)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--step-spans", type=int, default=80)
    ap.add_argument("--step-s", type=float, default=1.2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis").start()
        try:
            off = Timeline.off()
            off_with = min(per_span_us(off, args.spans, True) for _ in range(3))
            rows = {}
            for use_with in (True, False):
                tl = Timeline(redis.url, Keys(f"bench-{int(use_with)}"), "bench").start()
                rows[use_with] = min(per_span_us(tl, args.spans, use_with) for _ in range(3))
                t0 = time.perf_counter()
                tl.stop(timeout_s=600)
                drain_s = time.perf_counter() - t0
            # the writer alone: spans already buffered, one flush
            tl = Timeline(redis.url, Keys("bench-write"), "bench")
            for i in range(args.spans):
                tl.add("generate", 1.0, 2.0, "groups", group=i)
            t0 = time.perf_counter()
            written = tl.flush()
            write_us = (time.perf_counter() - t0) / written * 1e6
        finally:
            redis.stop()
    record = rows[True] - off_with
    print(f"spans: {args.spans} per variant (best of 3), embedded Redis")
    print(f"{'':<44}{'us/span':>10}")
    print(f"{'with timeline.span(...) (recorder on)':<44}{rows[True]:>10.2f}")
    print(f"{'with timeline.span(...) (recorder off)':<44}{off_with:>10.2f}")
    print(f"{'timeline.add(...) (recorder on)':<44}{rows[False]:>10.2f}")
    print(f"{'writer thread: XADD MAXLEN ~, pipelined':<44}{write_us:>10.2f}")
    print(f"(the last variant's buffer drained in {drain_s:.2f} s at stop)")
    in_path = args.step_spans * rows[True] / 1e6
    total = args.step_spans * (rows[True] + write_us) / 1e6
    print(f"per step of {args.step_s:g} s with {args.step_spans} spans: {in_path * 1e3:.3f} ms in the services' path "
          f"({in_path / args.step_s:.4%}), {total * 1e3:.3f} ms with the writer's time ({total / args.step_s:.4%}); "
          f"recording alone costs {record:.2f} us/span over the recorder off")


if __name__ == "__main__":
    main()
