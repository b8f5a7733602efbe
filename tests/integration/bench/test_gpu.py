"""bench/gpu.py, the GPU check, runs its code path on CPU with a tiny model (so it is ready when a GPU is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.long  # over 15 s in make test (39 s at 2dc2538)
@pytest.mark.deepspeed
def test_gpu_bench_runs_the_learner_step_publish_packing_broadcast_and_version_check_on_a_tiny_model(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--device", "cpu", "--tiny", "--no-generation",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert [r["zero_stage"] for r in report["learner"]] == [2, 3]
    for r in report["learner"]:
        assert r["steps_timed"] == 2 and r["tokens_per_s"] > 0 and r["loss"] == r["loss"]  # not NaN
        # every parameter published in bf16 (the file adds its safetensors header)
        assert 2 * report["parameters"] <= r["publish"]["bytes"] < 2 * report["parameters"] + (64 << 10)
    assert report["generation"] == {"skipped": "--no-generation"}
    assert report["device"] == "cpu" and report["peak_tflops"] == 0  # the dry run: no MFU on CPU
    packing = report["packing"]
    assert (packing["packed"]["packing"], packing["padded"]["packing"]) == (True, False)
    assert packing["packed"]["uneven"] and packing["padded"]["uneven"]
    # the same batches both ways: the same real tokens per step, however many the padded layout computes
    assert packing["packed"]["tokens_per_step"] == packing["padded"]["tokens_per_step"]
    assert packing["packed_over_padded"] > 0
    b = report["broadcast"]  # gloo between this process and a member (bench/transfer.py asserts the digest)
    assert b["backend"] == "gloo" and b["bytes"] == 50_000_000 and b["gb_per_s"] > 0
    v = report["published_versions"]  # ZeRO-3, files written behind a broadcast from reused host buffers
    assert v["host_buffers"] and v["zero_stage"] == 3 and v["distinct_versions"] == v["versions"] == 3
    assert v["mismatched"] == []


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow
def test_transfer_bench_times_every_piece_and_the_http_copy_is_the_version(tmp_path):
    out = tmp_path / "transfer.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/transfer.py"), "--gb", "0.05", "--dir", str(tmp_path),
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]  # the script asserts the HTTP copy's sha256
    report = json.loads(out.read_text())
    assert report["bytes"] == 50_000_000  # one piece of --gb (pieces are layer-sized, 256 MB, above it)
    assert set(report["gb_per_s"]) == {"d2h_pageable", "d2h_pinned", "write", "verify", "read", "http_loopback",
                                       "broadcast"}  # the script asserts the member's digest too
    assert all(v > 0 for v in report["gb_per_s"].values())
    assert set(report["transports"]) == {"volume", "http_stream", "files_local", "broadcast", "lora_adapter"}
    assert 20e6 < report["transports"]["lora_adapter"]["bytes"] < 50e6  # rank 16 on q/k/v/o of Qwen3-8B
