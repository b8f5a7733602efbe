"""The Makefile's contract: `make run` runs the main job, `make test` the suite, and CI calls `make test`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _recipe(target: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert match, f"no recipe for `make {target}`"
    return [line.strip() for line in match.group(1).splitlines()]


def test_make_run_runs_the_main_job_on_the_example_config():
    assert _recipe("run") == ["$(VENV)/bin/tandem run examples/arith/run.toml"]
    assert (ROOT / "examples/arith/run.toml").exists()


def test_make_test_runs_the_whole_suite_and_ci_calls_it():
    assert _recipe("test") == ["$(PY) -m pytest -q -ra"]
    assert "make test" in (ROOT / ".ci/run").read_text()
