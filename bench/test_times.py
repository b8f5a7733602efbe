"""Where a test run's time goes, per test file, from the JUnit XML report pytest writes.

    .venv/bin/python bench/test_times.py [.venv/test-report.xml] [--top 25]

``make test`` and ``make test-fast`` write the report (``--junitxml``). Each row is one test file:
its tests, the seconds they took (call plus setup and teardown, so a session fixture's start is
counted in the file whose test started it) and that time's share of the run. Under pytest-xdist
the files run on two workers at once, so the shares add up to the sum of both workers' time, not
to the wall clock; the run's wall time is printed beside it.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def per_file(report: Path) -> tuple[dict[str, tuple[int, float]], float]:
    """``({file: (tests, seconds)}, wall seconds)`` of the report's test cases."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    files: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for case in root.iter("testcase"):
        name = case.get("classname", "").split(".")
        # classname is the module's dotted path, then a class if the test has one
        while name and not Path(*name).with_suffix(".py").exists() and len(name) > 1:
            name = name[:-1]
        file = "/".join(name) + ".py"
        files[file][0] += 1
        files[file][1] += float(case.get("time") or 0.0)
    wall = sum(float(s.get("time") or 0.0) for s in suites)
    return {f: (n, t) for f, (n, t) in files.items()}, wall


def table(files: dict[str, tuple[int, float]], wall: float, top: int) -> str:
    total = sum(t for _, t in files.values()) or 1.0
    rows = sorted(files.items(), key=lambda kv: -kv[1][1])
    lines = [f"wall {wall:.0f} s; test time summed over workers {total:.0f} s; {len(files)} files", "",
             "| file | tests | s | share |", "|---|---:|---:|---:|"]
    for file, (n, t) in rows[:top]:
        lines.append(f"| `{file}` | {n} | {t:.0f} | {100 * t / total:.1f}% |")
    rest = rows[top:]
    if rest:
        lines.append(f"| {len(rest)} other files | {sum(n for _, (n, _) in rest)} | "
                     f"{sum(t for _, (_, t) in rest):.0f} | {100 * sum(t for _, (_, t) in rest) / total:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", type=Path, default=Path(".venv/test-report.xml"))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not args.report.exists():
        raise SystemExit(f"{args.report}: no report; `make test` or `make test-fast` writes it")
    print(table(*per_file(args.report), args.top))


if __name__ == "__main__":
    main()
