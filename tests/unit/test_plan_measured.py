"""The memory planner against measured memory: within 25% of every run bench/gpu.py recorded on a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "bench/results").glob("gpu-*.json"))
spec = importlib.util.spec_from_file_location("plan_vs_measured", ROOT / "bench/plan_vs_measured.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_the_measured_model_is_rebuilt_exactly():
    from examples.tiny import char_tokenizer

    report = json.loads(RESULTS[0].read_text())
    assert bench.preset_of(report).vocab == len(char_tokenizer())  # the parameter count leaves nothing over


@pytest.mark.parametrize("result", RESULTS, ids=lambda p: p.stem)
def test_learner_memory_is_predicted_within_25_percent(result):
    rows = bench.compare(json.loads(result.read_text()))
    assert rows
    for r in rows:
        assert 0.75 <= r["predicted_gb"] / r["measured_gb"] <= 1.25, r
