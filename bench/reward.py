"""Benchmark: sandboxed executions of short Python programs with assert tests.

Runs every problem of ``bench/data/problems.jsonl`` (a correct and an
incorrect solution each, 3-5 asserts) through three ways of sandboxing and
prints executions/s and p50/p99 latency side by side:

  (a) naive gVisor: one ``runsc --network=none do`` per execution
      (the solution and its tests through the same harness tandem uses);
  (b) tandem's gVisor backend (warm pool of minimal-root runsc sandboxes);
  (c) tandem's bubblewrap backend (fresh namespaces per execution).

Every verdict is checked: a correct solution must pass all its tests, an
incorrect one must fail at least one. Concurrency is the same for all three
(``--concurrency``, default: the number of CPU cores).

    python bench/reward.py [--repeat N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_server.sandbox.guest import GUEST_DIR  # noqa: E402
from reward_server.verifiers import code  # noqa: E402
from services.reward_specs import Limits, PythonTestsSpec  # noqa: E402

DATA = Path(__file__).parent / "data" / "problems.jsonl"
LIMITS = Limits(wall_s=10, cpu_s=10)


@dataclass(frozen=True)
class Execution:
    name: str
    program: str
    tests: list[str]
    should_pass: bool


@dataclass
class Figures:
    label: str
    latencies: list[float]
    wall_s: float
    wrong: list[str]

    def row(self) -> str:
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) * 1000
        p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] * 1000
        rate = len(lat) / self.wall_s
        ok = "all correct" if not self.wrong else f"{len(self.wrong)} WRONG"
        return f"{self.label:<34} {len(lat):>6} {rate:>10.2f} {p50:>9.0f} {p99:>9.0f}   {ok}"


def load(repeat: int) -> list[Execution]:
    problems = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    once = [Execution(p["name"], p[which], p["tests"], which == "correct")
            for p in problems for which in ("correct", "incorrect")]
    return once * repeat


async def naive_runsc(ex: Execution) -> bool:
    """One `runsc do` per execution: host file system read-only, host environment (as shipped)."""
    work = tempfile.mkdtemp(prefix="bench-naive-")
    try:
        Path(work, "solution.py").write_text(ex.program)
        proc = await asyncio.create_subprocess_exec(
            "runsc", "--network=none", "do", sys_python(), "-I", str(GUEST_DIR / "harness.py"),
            "solution.py", repr(float(LIMITS.wall_s)), "1", cwd=work,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await asyncio.wait_for(proc.communicate(json.dumps(ex.tests).encode()), LIMITS.wall_s + 10)
        verdicts = [json.loads(x) for x in out.decode().splitlines() if x.startswith('{"i"')]
        return len(verdicts) == len(ex.tests) and all(v["ok"] for v in verdicts)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def sys_python() -> str:
    return os.path.realpath("/usr/bin/python3") if os.path.exists("/usr/bin/python3") else sys.executable


def tandem_runner(sandbox):
    async def run(ex: Execution) -> bool:
        spec = PythonTestsSpec(tests=ex.tests, extract="whole", reward_mode="all", limits=LIMITS)
        result = await code.score("b", ex.program, spec, sandbox.run, sandbox.python)
        if result.reward is None:
            raise RuntimeError(f"{ex.name}: {result.status} {result.detail}")
        return result.reward == 1.0

    return run


async def measure(label: str, run, executions: list[Execution], concurrency: int) -> Figures:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    wrong: list[str] = []

    async def one(ex: Execution) -> None:
        async with gate:
            start = time.perf_counter()
            passed = await run(ex)
            latencies.append(time.perf_counter() - start)
            if passed != ex.should_pass:
                wrong.append(f"{ex.name} ({'correct' if ex.should_pass else 'incorrect'})")

    start = time.perf_counter()
    await asyncio.gather(*(one(ex) for ex in executions))
    return Figures(label, latencies, time.perf_counter() - start, wrong)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="run the problem set this many times")
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    from reward_server.sandbox.bwrap import BwrapSandbox
    from reward_server.sandbox.gvisor import GVisorSandbox

    executions = load(args.repeat)
    print(f"{len(executions)} executions ({len(executions) // 2 // args.repeat} problems x correct/incorrect"
          f" x {args.repeat}), concurrency {args.concurrency}, {os.cpu_count()} CPU cores")
    results = []
    results.append(await measure("(a) naive runsc do per execution", naive_runsc, executions, args.concurrency))

    gvisor = GVisorSandbox(workers=args.concurrency)
    start = time.perf_counter()
    await gvisor.start()
    await tandem_runner(gvisor)(executions[0])  # wait until the whole pool is warm
    warm_s = time.perf_counter() - start
    try:
        results.append(await measure("(b) tandem gVisor (warm pool)", tandem_runner(gvisor), executions,
                                     args.concurrency))
    finally:
        await gvisor.close()
    bwrap = BwrapSandbox(workers=args.concurrency)
    results.append(await measure("(c) tandem bubblewrap", tandem_runner(bwrap), executions, args.concurrency))
    await bwrap.close()

    print(f"\n{'backend':<34} {'execs':>6} {'execs/s':>10} {'p50 ms':>9} {'p99 ms':>9}   verdicts")
    for figures in results:
        print(figures.row())
    naive, ours = results[0], results[1]
    speedup = (len(ours.latencies) / ours.wall_s) / (len(naive.latencies) / naive.wall_s)
    print(f"\ngVisor pool start-up (once, not in the figures): {warm_s:.2f} s")
    print(f"(b) / (a) throughput: {speedup:.1f}x")
    wrong = [w for f in results for w in f.wrong]
    for w in wrong:
        print("wrong verdict:", w)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
