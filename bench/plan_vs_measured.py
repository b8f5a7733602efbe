"""The memory planner's learner figures against peak GPU memory measured by bench/gpu.py.

    .venv/bin/python bench/plan_vs_measured.py [bench/results/gpu-*.json ...]

For each recorded run (model shape, micro-batch, ZeRO stage, one GPU) it
builds the same architecture as a preset, asks ``deploy.plan`` for the
learner's share (``Plan.learner``: weights + gradients + optimizer + the larger
of the activations and the optimizer step's transients; the rollout
engine and the runtime allowance are left out, since bench/gpu.py runs no
engine and ``torch.cuda.max_memory_allocated`` counts tensors only) and
prints predicted against measured, side by side. tests/unit/deploy/test_plan.py
holds the planner to within 25% of every recorded run. The recorded runs
predate chunked logits and packed micro-batches (their 99-token vocabulary
makes the logits a rounding error either way).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.plan import plan  # noqa: E402
from deploy.presets import ModelPreset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30


def preset_of(report: dict) -> ModelPreset:
    """The measured model as a preset; its vocabulary is what its parameter count leaves (untied head)."""
    m = report["model"]
    h, d = m["hidden"], m["head_dim"]
    per_layer = (h * m["heads"] * d * 2 + h * m["kv_heads"] * d * 2  # q, o and k, v
                 + 3 * h * m["intermediate"] + 2 * h + 2 * d)  # MLP, the two norms, q/k norms
    vocab = (report["parameters"] - m["layers"] * per_layer - h) // (2 * h)
    return ModelPreset(name="bench/random-qwen3", params=report["parameters"], active_params=report["parameters"],
                       layers=m["layers"], hidden=h, intermediate=m["intermediate"], heads=m["heads"],
                       kv_heads=m["kv_heads"], head_dim=d, vocab=vocab, context=1024, tied_embeddings=False)


def compare(report: dict) -> list[dict]:
    """(stage, micro-batch tokens, predicted GB, measured GB) for each learner run of ``report``."""
    preset, batch = preset_of(report), report["batch"]
    seq = batch["prompt_len"] + batch["completion_len"]
    seqs_per_micro_batch = batch["micro_batch_tokens"] // seq
    rows = []
    for run in report["learner"]:
        p = plan(preset, "full", "1xH200", group_size=seqs_per_micro_batch, max_tokens=seq,
                 micro_batch_tokens=seqs_per_micro_batch * seq, zero_stage=run["zero_stage"],
                 checkpointing=batch["checkpointing"])
        predicted = p.learner
        rows.append({"zero_stage": run["zero_stage"], "micro_batch_tokens": seqs_per_micro_batch * seq,
                     "predicted_gb": predicted, "measured_gb": run["peak_memory_gib"] * GIB / 1e9})
    return rows


def main() -> None:
    files = [Path(f) for f in sys.argv[1:]] or sorted(RESULTS.glob("gpu-*.json"))
    print(f"{'run':28} {'ZeRO':>4} {'micro-batch':>11} {'predicted GB':>12} {'measured GB':>11} {'ratio':>6}")
    for f in files:
        report = json.loads(f.read_text())
        for r in compare(report):
            print(f"{f.stem:28} {r['zero_stage']:>4} {r['micro_batch_tokens']:>11} {r['predicted_gb']:>12.1f} "
                  f"{r['measured_gb']:>11.1f} {r['predicted_gb'] / r['measured_gb']:>6.2f}")
    print(f"(hardware: {json.loads(files[0].read_text())['hardware'].get('gpu', 'cpu')}; "
          "predicted = Plan.learner: weights + gradients + optimizer + the larger of activations and "
          "the optimizer step, from deploy/plan.py)")


if __name__ == "__main__":
    main()
