"""The memory planner against measured memory: within 25% of every run bench/gpu.py recorded on a GPU
and of every configuration bench/plan_cpu.py measured on CPU (bench/results/cpu-plan.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deploy.plan import plan
from deploy.presets import preset

ROOT = Path(__file__).resolve().parents[3]
RESULTS = sorted((ROOT / "bench/results").glob("gpu-*.json"))
CPU_ROWS = json.loads((ROOT / "bench/results/cpu-plan.json").read_text())["rows"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("plan_vs_measured")
cpu = _load("plan_cpu")


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


def test_cpu_results_cover_three_sizes_three_stages_with_and_without_checkpointing():
    assert sorted((r["size"], r["zero_stage"], r["checkpointing"]) for r in CPU_ROWS) == sorted(
        (s, z, c) for s in ("5m", "25m", "wide") for z in (0, 2, 3) for c in (False, True))
    assert {r["dtype_bytes"] for r in CPU_ROWS} == {4}  # the learner's default precision, fp32
    # the learner's path today: packed micro-batches, logits a chunk at a time
    assert all(r["batch"]["packing"] and r["batch"]["logit_chunk_tokens"] == cpu.LOGIT_CHUNK for r in CPU_ROWS)


def test_the_wide_model_measures_the_logits_term():
    # a 65,536-token vocabulary: one chunk of logits (12 c V bytes, deploy/plan.py) is a large share of
    # the peak, so the within-25% check of these rows covers the logits term
    wide = [r for r in CPU_ROWS if r["size"] == "wide"]
    assert wide
    for row in wide:
        assert cpu.preset_of(row).vocab == cpu.WIDE_VOCAB
        assert 12 * row["batch"]["logit_chunk_tokens"] * cpu.WIDE_VOCAB / 1e6 > 0.15 * row["measured_mb"], row


def _key(row: dict) -> tuple[str, int, bool]:
    return row["size"], row["zero_stage"], row["checkpointing"]


def _id(row: dict) -> str:
    return f"{row['size']}-zero{row['zero_stage']}-ckpt{int(row['checkpointing'])}"


@pytest.mark.parametrize("row", CPU_ROWS, ids=_id)
def test_cpu_learner_memory_is_predicted_within_25_percent(row):
    # predicted from today's planner; measured as recorded
    assert 0.75 <= cpu.predict(row) / row["measured_mb"] <= 1.25, (cpu.predict(row), row)


STEP_PEAKS = [r for r in CPU_ROWS if r["step_peak_mb"] == r["measured_mb"]]
"""Configurations whose measured peak fell inside the optimizer step (all at ZeRO >= 1)."""


def test_step_peaks_were_measured_at_zero_1_and_up():
    assert STEP_PEAKS and all(r["zero_stage"] >= 1 for r in STEP_PEAKS)


@pytest.mark.parametrize("row", [r for r in STEP_PEAKS if r["checkpointing"]], ids=_id)
def test_where_the_peak_is_in_the_optimizer_step_the_planner_counts_the_step(row):
    # with checkpointing the activations are small and the peak falls in the optimizer step, after
    # they are freed: the planner's figure is its state plus the step's transients, not its state
    # plus the activations. (The wide model's peak is in the step without checkpointing too; there
    # the planner's activations, a chunk of logits included, come within 7% of the step's
    # transients and it takes the larger: 1.02x and 0.80x the measured peak.)
    p = cpu.planned(row)
    assert p.optimizer_step > p.activations  # the step, not the activations, sets the figure


@pytest.mark.parametrize("row", [r for r in CPU_ROWS if r["zero_stage"] in (0, 2)], ids=_id)
def test_cpu_replay_saw_every_tensor(row):
    # after the last step exactly the fp32 weights and Adam state are live (gradients are
    # freed): weights + m + v at ZeRO-0, plus ZeRO's fp32 master copy at ZeRO-2, 4 bytes each
    words = {0: 3, 2: 4}[row["zero_stage"]]
    assert row["live_at_end_mb"] == pytest.approx(4 * words * row["parameters"] / 1e6, rel=1e-3)
    # the reduce bucket was allocated (at ZeRO >= 1) and is the size DeepSpeed's default gives
    assert (row["bucket_allocations"] >= 1) == (row["zero_stage"] >= 1)
    assert row["bucket_mb"] == (5e8 * 4 / 1e6 if row["zero_stage"] >= 1 else 0)


def test_replay_peaks_and_sets_the_bucket_apart():
    events = [(3, 100), (1, 50), (2, 1000), (4, -1000), (5, 30), (6, -50)]  # out of order on purpose
    assert cpu.peaks(events, bucket=1000, steps=[(5, 6)]) == {
        "peak": 1150, "peak_without_bucket": 180, "peak_in_step": 180, "live_at_end": 130, "bucket_allocations": 1}
    assert cpu.peaks(events, bucket=0)["peak_without_bucket"] == 1150
    assert cpu.peaks(events, bucket=1000, steps=[(6, 7)])["peak_in_step"] == 130
    # a bucket not yet collected at the end is no learner state
    assert cpu.peaks(events[:3] + events[4:], bucket=1000)["live_at_end"] == 130


def test_dtype_bytes_widens_the_learner_only():
    p = preset("qwen3-8b-base")
    bf16, fp32 = (plan(p, "full", "4xH100", zero_stage=2, dtype_bytes=b) for b in (2, 4))
    assert bf16 == plan(p, "full", "4xH100", zero_stage=2)  # the default is bf16
    assert fp32.weights == pytest.approx(2 * bf16.weights) and fp32.gradients == pytest.approx(2 * bf16.gradients)
    assert fp32.activations_full > 1.9 * (bf16.activations_full - 8 * 8192 * p.vocab / 1e9)
    assert fp32.optimizer == bf16.optimizer  # fp32 master + m + v either way at ZeRO >= 1
    assert (fp32.rollout_weights, fp32.kv_cache) == (bf16.rollout_weights, bf16.kv_cache)  # vLLM serves bf16
    # without ZeRO an fp32 learner's Adam updates the weights themselves: m + v only
    assert plan(p, "full", "4xH100", zero_stage=0, dtype_bytes=4).optimizer == pytest.approx(8 * p.params / 1e9)
    with pytest.raises(ValueError, match="dtype_bytes"):
        plan(p, "full", "4xH100", dtype_bytes=3)
