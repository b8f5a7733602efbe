"""The memory planner's learner figures against peak memory measured on CPU.

    .venv/bin/python bench/plan_cpu.py [--out bench/results/cpu-plan.json] [--sizes 5m,25m,wide] [--stages 0,2,3]

For three random Qwen3-architecture models (about 5M and 25M parameters with
the 99-token character vocabulary of ``examples.tiny``, and "wide": 35M
parameters, most of them a 65,536-token embedding and head, where one chunk
of logits is a third of the peak), DeepSpeed ZeRO stages 0, 2 and 3 and
activation checkpointing off and on (18 configurations), each in a fresh child process
(one rank, ``DS_ACCELERATOR=cpu``, gloo) so that no peak carries over: the
learner's own ``learner.engine.LearnerEngine`` (the code path ``bench/gpu.py``
times) in its default precision, fp32, runs ``STEPS`` real GRPO optimizer
steps on synthetic groups (``bench.gpu.synthetic_groups`` through
``learner.batch.build_batch``). The table puts the peak beside the
``deploy.plan`` figure for the same shape (``dtype_bytes=4``),
``Plan.learner``: weights + gradients + optimizer + the larger of the
activations and the optimizer step's transients, one micro-batch of ``GROUP_SIZE``
sequences of ``SEQ_LEN`` tokens, packed (the learner's default,
``learner.packing``) into one row, its log-probs computed ``LOGIT_CHUNK``
tokens at a time (``learner.logit_chunk_tokens``). Two steps, because Adam's moments appear at
the first step: the second backward is the first to hold them beside the
activations.

The measure is the CPU analogue of ``torch.cuda.max_memory_allocated`` (what
``bench/plan_vs_measured.py`` compares on a GPU): the peak of live tensor
bytes from just before the engine is built to the end of the last step,
replayed from the allocation and free events torch's profiler records with
``profile_memory=True`` (torch 2.13's CPU build has no allocator statistics;
``torch.accelerator.max_memory_allocated`` covers accelerators only). The
tensors live at the end are a check that no allocation went unseen: exactly
the weights and the optimizer state (12P bytes at ZeRO-0, 16P at ZeRO-2, P
parameters; 20-23P at ZeRO-3, which also keeps its gradient buffer, some
gathered parameters and its reduce bucket). The rise in peak RSS (VmHWM) is recorded too but
is not the measure: it adds a few hundred MB that are no tensor (DeepSpeed's
shared-memory op, gloo, oneDNN, the modules ``from_pretrained`` imports,
malloc's free lists), more than the 5M model's whole learner state, and it
misses allocated pages never touched.

DeepSpeed's gradient reduce bucket is reported apart. At ZeRO >= 1 the ZeRO
optimizer allocates ``reduce_bucket_size`` (default 5e8) elements of the
gradient dtype at the first backward, whatever the model's size: 2 GB here in
fp32, 1 GB in bf16 on a GPU. The planner does not count it (see
``deploy/plan.py``), so ``measured`` is the peak with that one allocation,
found by its exact size read from the engine, taken out of the replay; the
``bucket`` column gives its size and ``peak`` the peak with it. On CPU only
the pages a step writes are resident, so the bucket barely shows in RSS.

``in step`` is the highest point inside DeepSpeed's optimizer step (its
window marked in the profile with ``record_function``). Its transients (an
fp32 copy of the gradient partition and Adam's ``sqrt(v) + eps``, 4 + 4
bytes per parameter at ZeRO >= 1) live after the activations are freed;
with checkpointing at ZeRO >= 2 the step is where the peak falls. The
planner counted only the step's state until this benchmark showed 25M ZeRO-3
with checkpointing at 0.66 of the measured peak; it now takes the larger of
the activations and those transients (``Plan.optimizer_step``). ZeRO-3's step
peak is a further ~6 bytes per parameter above ZeRO-2's, not analysed here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plan_vs_measured import preset_of  # noqa: E402
from deploy.plan import plan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {  # hidden, layers, heads, kv heads, head dim, MLP
    "5m": dict(hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64, intermediate=768),
    "25m": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536),
    "wide": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768),
}
WIDE_VOCAB = 65536
"""The "wide" model's vocabulary (the others have the character tokenizer's)."""
GROUP_SIZE, PROMPT_LEN, SEQ_LEN, STEPS = 4, 32, 256, 2
"""One group of G sequences (prompt + completion = SEQ_LEN tokens) per step: one micro-batch of G x SEQ_LEN."""
LOGIT_CHUNK = 256
"""``learner.logit_chunk_tokens`` here: a quarter of the micro-batch's completion tokens per chunk."""
MB = 1e6
STEP_MARK = "tandem.optimizer_step"


def planned(row: dict):
    """The planner's ``deploy.plan.Plan`` for a measured ``row`` (model shape, batch, stage, checkpointing)."""
    batch = row["batch"]
    return plan(preset_of(row), "full", "1xH200", group_size=batch["group_size"], max_tokens=batch["seq_len"],
                micro_batch_tokens=batch["group_size"] * batch["seq_len"],
                logit_chunk_tokens=batch["logit_chunk_tokens"], zero_stage=row["zero_stage"],
                checkpointing=row["checkpointing"], dtype_bytes=row["dtype_bytes"])


def predict(row: dict) -> float:
    """The planner's learner figure, in MB, for a measured ``row``."""
    return planned(row).learner * 1e9 / MB


def peaks(events: list[tuple[int, int]], bucket: int, steps: list[tuple[int, int]] = ()) -> dict:
    """Replay (time, +/- bytes) allocation events: the peak; the peak without allocations of exactly
    ``bucket`` bytes, overall and within the ``steps`` (start, end) windows; the bytes live at the
    end without the bucket (whether it is still alive then depends on when Python's cycle collector
    ran); and how often the bucket was allocated."""
    live = live_wo = peak = peak_wo = peak_step = count = 0
    for t, nbytes in sorted(events, key=lambda e: e[0]):  # stable: same-time events in record order
        live += nbytes
        peak = max(peak, live)
        if bucket and abs(nbytes) == bucket:
            count += nbytes > 0
            continue
        live_wo += nbytes
        peak_wo = max(peak_wo, live_wo)
        if any(start <= t <= end for start, end in steps):
            peak_step = max(peak_step, live_wo)
    return {"peak": peak, "peak_without_bucket": peak_wo, "peak_in_step": peak_step, "live_at_end": live_wo,
            "bucket_allocations": count}


def _vm(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_here(model: Path, zero_stage: int, checkpointing: bool) -> dict:
    """Build the learner's engine and run STEPS train steps in this process; the figures in bytes."""
    import deepspeed  # noqa: F401  (imported before the window: its import is no learner memory)
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.gpu import synthetic_groups
    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from services.config import RunConfig

    cfg = RunConfig.model_validate({
        "name": "plan-cpu", "model": {"path": str(model), "max_model_len": SEQ_LEN},
        "data": {"train": "unused.jsonl"},
        "sampling": {"group_size": GROUP_SIZE, "max_tokens": SEQ_LEN - PROMPT_LEN},
        "learner": {"zero_stage": zero_stage, "precision": "fp32", "lr": 1e-5,
                    "micro_batch_tokens": GROUP_SIZE * SEQ_LEN, "gradient_checkpointing": checkpointing,
                    "packing": True, "logit_chunk_tokens": LOGIT_CHUNK},
        "loss": {"beta": 0.0},
    })
    rss_before = _vm("VmRSS")
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine = LearnerEngine(cfg)
        ds_step = engine.engine.step

        def annotated_step(*a, **kw):  # marks the optimizer step's window in the profile; runs it as is
            with record_function(STEP_MARK):
                return ds_step(*a, **kw)

        engine.engine.step = annotated_step
        for step in range(STEPS):
            groups = synthetic_groups(engine.vocab_size, 1, GROUP_SIZE, PROMPT_LEN, SEQ_LEN - PROMPT_LEN, seed=step)
            stats = engine.train_step(build_batch(groups, cfg.loss, cfg.sampling.max_tokens))
    seconds = time.perf_counter() - started
    assert stats["micro_batches"] == 1 and stats["tokens"] > 0 and engine.packed, stats
    dtype_bytes = next(engine.engine.module.parameters()).element_size()  # the learner's precision
    bucket = engine.engine.zero_reduce_bucket_size() * dtype_bytes if zero_stage >= 1 else 0
    # torch's own record of every CPU allocation (+bytes) and free (-bytes) in the window
    recorded = prof.profiler.kineto_results.events()
    events = [(e.start_ns(), e.nbytes()) for e in recorded
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    steps = [(e.start_ns(), e.end_ns()) for e in recorded if e.name() == STEP_MARK]
    assert len(steps) == STEPS, steps
    return {**peaks(events, bucket, steps), "bucket": bucket, "dtype_bytes": dtype_bytes,
            "rss_rise": _vm("VmHWM") - rss_before, "seconds": round(seconds, 1)}


def measure(model: Path, zero_stage: int, checkpointing: bool, timeout: float = 600) -> dict:
    """``measure_here`` in a fresh child process (one rank on CPU), so no peak carries over."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # one rank of its own, whatever launched this
    spec = json.dumps({"model": str(model), "zero_stage": zero_stage, "checkpointing": checkpointing})
    proc = subprocess.run([sys.executable, __file__, "--one", spec], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ZeRO-{zero_stage} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_model(out: Path, size: str) -> tuple[Path, int]:
    """A random fp32 Qwen3 of ``SIZES[size]`` at ``out``; returns (path, parameter count)."""
    from examples.tiny import parameter_count, tiny_qwen3

    if size != "wide":
        path = tiny_qwen3(out, **SIZES[size], max_positions=SEQ_LEN, dtype="float32", tie_embeddings=False)
        return path, parameter_count(path)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = SIZES[size]  # the learner reads the model only: no tokenizer needed
    config = Qwen3Config(vocab_size=WIDE_VOCAB, hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                         num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                         num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"], max_position_embeddings=SEQ_LEN,
                         tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out, parameter_count(out)


def run(size: str, model: Path, params: int, zero_stage: int, checkpointing: bool) -> dict:
    """One configuration measured, as a row of the results file (MB), with the planner's figure."""
    m = measure(model, zero_stage, checkpointing)
    row = {"size": size, "parameters": params, "model": SIZES[size], "zero_stage": zero_stage,
           "checkpointing": checkpointing, "dtype_bytes": m["dtype_bytes"],
           "batch": {"group_size": GROUP_SIZE, "prompt_len": PROMPT_LEN, "seq_len": SEQ_LEN, "steps": STEPS,
                     "packing": True, "logit_chunk_tokens": LOGIT_CHUNK},
           "measured_mb": round(m["peak_without_bucket"] / MB, 2), "step_peak_mb": round(m["peak_in_step"] / MB, 2),
           "peak_mb": round(m["peak"] / MB, 2),
           "bucket_mb": round(m["bucket"] / MB, 2), "bucket_allocations": m["bucket_allocations"],
           "live_at_end_mb": round(m["live_at_end"] / MB, 2), "rss_rise_mb": round(m["rss_rise"] / MB, 1),
           "seconds": m["seconds"]}
    row["predicted_mb"] = round(predict(row), 2)
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'model':6} {'params':>10} {'ZeRO':>4} {'ckpt':>4} {'predicted MB':>12} {'measured MB':>11} "
             f"{'ratio':>6} {'in step MB':>10} {'bucket MB':>9} {'peak MB':>8} {'RSS rise MB':>11} {'s':>5}"]
    for r in rows:
        lines.append(f"{r['size']:6} {r['parameters']:>10,} {r['zero_stage']:>4} {'on' if r['checkpointing'] else 'off':>4} "
                     f"{predict(r):>12.1f} {r['measured_mb']:>11.1f} {predict(r) / r['measured_mb']:>6.2f} {r['step_peak_mb']:>10.1f} "
                     f"{r['bucket_mb']:>9.0f} {r['peak_mb']:>8.1f} {r['rss_rise_mb']:>11.1f} {r['seconds']:>5.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu-plan.json")
    ap.add_argument("--sizes", default="5m,25m,wide")
    ap.add_argument("--stages", default="0,2,3")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one configuration, JSON on the last line
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(measure_here(Path(spec["model"]), spec["zero_stage"], spec["checkpointing"])))
        return
    import torch

    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-plan-cpu-") as tmp:
        for size in args.sizes.split(","):
            model, params = build_model(Path(tmp) / size, size)
            for stage in (int(s) for s in args.stages.split(",")):
                for checkpointing in (False, True):
                    rows.append(run(size, model, params, stage, checkpointing))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    import deepspeed

    report = {"hardware": {"python": platform.python_version(), "torch": torch.__version__,
                           "deepspeed": deepspeed.__version__, "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads()},
              "measure": "peak live tensor bytes (torch profiler memory events), DeepSpeed's reduce bucket apart",
              "rows": rows, "wall_s": round(time.perf_counter() - started, 1)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(rows))
    print(f"(CPU, fp32 learner, one rank; micro-batch {GROUP_SIZE} x {SEQ_LEN} tokens packed, logits "
          f"{LOGIT_CHUNK} tokens at a time, {STEPS} steps; "
          f"predicted = deploy/plan.py Plan.learner, dtype_bytes=4; "
          f"measured = peak live tensor bytes without DeepSpeed's reduce bucket; {report['wall_s']} s)")


if __name__ == "__main__":
    main()
