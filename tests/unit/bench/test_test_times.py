"""bench/test_times.py: the per-file table of a pytest JUnit report."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.test_times import per_file, table  # noqa: E402

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4" time="50.0">
<testcase classname="tests.unit.bench.test_test_times" name="a" time="1.5"/>
<testcase classname="tests.unit.bench.test_test_times" name="b" time="2.5"/>
<testcase classname="tests.unit.bench.test_pools" name="c" time="30.0"/>
<testcase classname="tests.unit.bench.test_e2e_shape.TestShape" name="d" time="6.0"/>
</testsuite></testsuites>
"""


def test_times_add_up_per_file_and_a_class_belongs_to_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    files, wall = per_file(report)
    assert wall == 50.0
    assert files == {"tests/unit/bench/test_test_times.py": (2, 4.0), "tests/unit/bench/test_pools.py": (1, 30.0),
                     "tests/unit/bench/test_e2e_shape.py": (1, 6.0)}
    lines = table(files, wall, top=2).splitlines()
    assert lines[4] == "| `tests/unit/bench/test_pools.py` | 1 | 30 | 75.0% |"  # the longest first
    assert lines[6] == "| 1 other files | 2 | 4 | 10.0% |"
