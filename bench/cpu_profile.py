"""Where a run's CPU goes, by function: ``tandem run`` under py-spy, every service sampled.

    .venv/bin/python bench/cpu_profile.py [--config examples/arith/run.toml] [--rate 50] [--out bench/results/profile]

Runs the config with ``py-spy record --subprocesses`` (a sampling profiler: it reads each process's
Python stacks from outside, ``--rate`` times a second, only while a thread is on the CPU) and writes

- ``OUT/flame.svg``: py-spy's own flame graph of every process of the run (the figure
  docs/performance.md, "Where the CPU goes", shows);
- a table on stdout, read from that SVG: each process's share of the samples, then the per-sample path
  by part (HTTP, JSON and msgpack, Redis round trips, the ledger, timeline spans, admission, scoring,
  vLLM, the learner's step), each part's share of its process's samples;
- the run's own CPU account (``summary.json``'s ``cpu``: CPU-seconds per trained sample by service).

The model must be built first (``make run`` builds it); py-spy comes with the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PARTS = {
    "HTTP clients and parsing (httpx, httpcore, h11)": re.compile(r"\((?:[^)]*/)?(?:httpx|httpcore|h11)/"),
    "JSON / msgpack / pydantic": re.compile(r"\((?:[^)]*/)?(?:json|msgpack|pydantic|pydantic_core)/|orjson"),
    "Redis client": re.compile(r"\((?:[^)]*/)?redis/"),
    "ledger (broker/ledger.py)": re.compile(r"\(broker/ledger\.py"),
    "admission (broker/admission.py)": re.compile(r"\(broker/admission\.py"),
    "timeline spans (services/timeline.py)": re.compile(r"\(services/timeline\.py"),
    "service clients (services/clients.py: scoring, control)": re.compile(r"\(services/clients\.py"),
    "vLLM": re.compile(r"\((?:[^)]*/)?vllm/"),
    "torch": re.compile(r"\((?:[^)]*/)?torch/"),
    "DeepSpeed": re.compile(r"\((?:[^)]*/)?deepspeed/"),
}
"""A part is counted in a sample when a frame of the sample's stack matches (a sample may count in several)."""


def record(config: Path, out: Path, rate: int) -> Path:
    """Run ``tandem run config`` under py-spy; return the run directory."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy is not installed: it comes with the bench extra (make bench-e2e, or pip install -e '.[bench]')")
    runs = out / "runs"
    cmd = [spy, "record", "--subprocesses", "--rate", str(rate), "--format", "flamegraph",
           "--output", str(out / "flame.svg"), "--",
           str(Path(sys.executable).parent / "tandem"), "run", str(config), "--runs", str(runs)]
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    print(done.stdout[-2000:])
    if done.returncode != 0:
        sys.exit(f"the run under py-spy exited {done.returncode}")
    return next(Path(line) for line in reversed(done.stdout.strip().splitlines()) if line.startswith("/"))


Frame = tuple[int, float, float, str]
"""``(depth, x, width, title)`` of one frame of py-spy's flame graph; title ``function (file:line) (N samples, P%)``."""


def frames(svg: Path) -> list[Frame]:
    text = svg.read_text()
    out = []
    for m in re.finditer(r'<g><title>(.*?)</title><rect x="([\d.]+)%" y="([\d.]+)" width="([\d.]+)%"', text, re.S):
        out.append((round(float(m.group(3))), float(m.group(2)), float(m.group(4)), html.unescape(m.group(1))))
    return out


def samples_of(title: str) -> int:
    m = re.search(r"\(([\d,]+) samples?, [\d.]+%\)$", title)
    return int(m.group(1).replace(",", "")) if m else 0


def name_of(title: str) -> str:
    return re.sub(r" \([\d,]+ samples?, [\d.]+%\)$", "", title)


EPS = 0.002
"""py-spy rounds x and width to 4 decimals (percent of the graph's width)."""


def _inside(outer: Frame, f: Frame) -> bool:
    return f[0] > outer[0] and outer[1] - EPS <= f[1] and f[1] + f[2] <= outer[1] + outer[2] + EPS


def processes(fs: list[Frame]) -> list[tuple[str, int, list[Frame]]]:
    """Each process of the run: its name, its own samples (a child process is nested in its parent's
    frame in py-spy's graph: not counted here) and its own frames, most samples first."""
    procs = [f for f in fs if name_of(f[3]).startswith("process ")]
    out = []
    for p in procs:
        nested = [q for q in procs if _inside(p, q)]
        own = [f for f in fs if _inside(p, f) and not any(q is f or _inside(q, f) for q in nested)]
        direct = [q for q in nested if not any(_inside(r, q) for r in nested)]
        out.append((name_of(p[3]), samples_of(p[3]) - sum(samples_of(q[3]) for q in direct), own))
    return sorted(out, key=lambda t: -t[1])


def parts(own: list[Frame]) -> dict[str, int]:
    """Samples under a frame of each part of :data:`PARTS` (the outermost such frame: none counted twice)."""
    out = {}
    for part, pattern in PARTS.items():
        count, end = 0, -1.0
        for _depth, x, w, t in sorted((f for f in own if pattern.search(f[3])), key=lambda f: (f[1], f[0])):
            if x >= end - EPS:
                count += samples_of(t)
                end = x + w
        if count:
            out[part] = count
    return out


def self_time(own: list[Frame], top: int) -> list[tuple[str, int]]:
    """The functions with the most samples of their own (their frame's minus their callees')."""
    by_depth: dict[int, list[Frame]] = {}
    for f in own:
        by_depth.setdefault(f[0], []).append(f)
    totals: dict[str, int] = {}
    for f in own:
        below = sum(samples_of(c[3]) for c in by_depth.get(f[0] + 16, []) if _inside(f, c))
        name = name_of(f[3])
        totals[name] = totals.get(name, 0) + samples_of(f[3]) - below
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arith/run.toml")
    ap.add_argument("--rate", type=int, default=50, help="samples per second per process")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/profile")
    ap.add_argument("--svg", type=Path, help="only read an existing flame graph")
    ap.add_argument("--top", type=int, default=8, help="functions shown per process")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = None
    svg = args.svg
    if svg is None:
        run_dir = record(args.config.resolve(), args.out.resolve(), args.rate)
        svg = args.out / "flame.svg"
    fs = frames(svg)
    print(f"\n{svg}: each process's own samples, by part of the per-sample path, and its top functions\n")
    print("| process | part or function (own samples) | samples | share |\n|---|---|---:|---:|")
    for proc, n, own in processes(fs):
        print(f"| {proc[:90]} | (all) | {n} | 100.0% |")
        for part, count in parts(own).items():
            print(f"|  | {part} | {count} | {count / n:.1%} |")
        for function, count in self_time(own, args.top):
            print(f"|  | `{function[:110]}` | {count} | {count / n:.1%} |")
    if run_dir is not None:
        cpu = json.loads((run_dir / "summary.json").read_text()).get("cpu") or {}
        print(f"\nthe run's CPU account ({run_dir}/summary.json): {cpu.get('per_sample_s')} CPU-s per trained "
              f"sample over {cpu.get('samples_trained')} samples")
        print("| service | CPU-s | per trained sample | by process |\n|---|---:|---:|---|")
        for name, c in sorted(cpu.get("services", {}).items(), key=lambda kv: -kv[1]["cpu_s"]):
            procs = ", ".join(f"{p} {s:.1f}" for p, s in sorted(c["processes"].items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {c['cpu_s']:.1f} | {c['per_sample_s']:.4f} | {procs} |")


if __name__ == "__main__":
    main()
