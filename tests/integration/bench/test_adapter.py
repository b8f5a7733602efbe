"""bench/adapter.py, adapter against merged LoRA versions, runs end to end on the tiny model: both
formats written by the learner's writer, each loaded by a real vLLM engine (LoRA-enabled for adapters)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.long
def test_adapter_bench_loads_both_formats_and_an_adapter_is_its_lora_matrices(tmp_path):
    out = tmp_path / "adapter.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/adapter.py"), "--sizes", "tiny", "--versions", "2",
                           "--max-tokens", "8", "--rounds", "1", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]  # the script asserts each reload and one adapter left
    (r,) = json.loads(out.read_text())["results"]
    assert r["size"] == "tiny" and r["rank"] == 8
    for kind in ("merged", "adapter"):
        assert len(r[kind]["reload_s"]) == 2 and all(s > 0 for s in r[kind]["reload_s"])
        assert len(r[kind]["tokens_per_s"]) == 1 and r[kind]["tokens_per_s_median"] > 0
    # float32: an adapter is its lora_A/lora_B matrices plus a header; merged versions the whole model
    assert 4 * r["adapter_parameters"] <= r["adapter"]["bytes"] < 4 * r["adapter_parameters"] + (16 << 10)
    assert 4 * r["parameters"] <= r["merged"]["bytes"] < 4 * r["parameters"] + (64 << 10)
    assert r["bytes_ratio"] == r["merged"]["bytes"] / r["adapter"]["bytes"] > 5
