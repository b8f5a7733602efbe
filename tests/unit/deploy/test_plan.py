"""The memory planner against the published planning table, and ``tandem plan``.

The table (GPUs a GRPO run needs, per model and mode):

| model | LoRA/QLoRA GRPO | full-parameter GRPO |
|---|---|---|
| Qwen3-4B-Base | 1x 24-48 GB | 1x 80 GB or 2x 40-48 GB |
| Qwen3-8B-Base | 1x 40-80 GB | 2-4x 80 GB |
| OLMo-3-1025-7B | 1x 40-80 GB | 2-4x 80 GB |
| Qwen3-14B-Base | 1-2x 80 GB | 4-8x 80 GB |
| Qwen3-30B-A3B-Base | 2-4x 80 GB | 8+x 80 GB |
| OLMo-3-1125-32B | 4x 80 GB | 8-16+x 80 GB |

Checked at the planner's defaults: G = 8 completions of L = 1024 tokens,
the learner's micro-batch budget (8,192 tokens) and logit chunk (1,024 tokens),
activation checkpointing on, 2 groups in flight, loss.beta = 0, no offload
unless a case says so. A cell holds when the run fits (at some ZeRO stage) at
the cell's upper bound and fits at no ZeRO stage below its lower bound. For
LoRA the upper bound is checked for both LoRA and QLoRA and the lower bound
for LoRA; QLoRA, which exists to go lower, is allowed to. Every upper bound
also holds at L = 2,048 (issue 24: with the whole group's logits in one
micro-batch, 8B LoRA on one H100 and 14B full on eight did not).

The table counts a run's GPUs, so its cells are checked in the layout where
the whole run is on those GPUs: colocated (learner and vLLM share them). As
deployed on Modal the rollout servers have GPUs of their own
(``deploy/layout.py``); ``test_separate_rollout_gpus_never_need_more_learner_gpus``
checks that layout against the table's upper bounds.
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from deploy.plan import Mode, candidates, parse_gpus, plan, smallest_fit
from deploy.presets import PRESETS, preset


def fits(model: str, mode: str, gpus: str, offload: bool = False, **kwargs) -> bool:
    """Whether the whole run fits on ``gpus`` (the table counts a run's GPUs: learner and rollout engine on
    the same ones, the colocated layout) at some ZeRO stage."""
    stages = (1, 2, 3) if offload else (0, 1, 2, 3)
    kwargs.setdefault("colocated", True)
    return any(plan(preset(model), mode, gpus, zero_stage=z, offload=offload, **kwargs).fits for z in stages)


# (model, upper bound that must fit, a configuration below the lower bound that must not)
LORA_CELLS = [
    ("qwen3-4b-base", "1xL40S", None),  # 24 GB is the smallest type planned for: nothing below
    ("qwen3-8b-base", "1xH100", "1xL4"),
    ("olmo-3-1025-7b", "1xH100", "1xL4"),
    ("qwen3-14b-base", "2xH100", "1xL40S"),
    ("qwen3-30b-a3b-base", "4xH100", "1xH100"),
    ("olmo-3-1125-32b", "4xH100", "2xH100"),
]
FULL_CELLS = [
    ("qwen3-8b-base", "4xH100", "1xH100"),
    ("olmo-3-1025-7b", "4xH100", "1xH100"),
    ("qwen3-14b-base", "8xH100", "2xH100"),
    ("qwen3-30b-a3b-base", "16xH100", "4xH100"),  # "8+": see test_moe_full_needs_more_than_eight
    ("olmo-3-1125-32b", "16xH100", "4xH100"),
]


@pytest.mark.parametrize(("model", "upper", "below"), LORA_CELLS)
def test_lora_cells(model, upper, below):
    assert fits(model, "lora", upper)
    assert fits(model, "qlora", upper)
    if below:
        assert not fits(model, "lora", below)


@pytest.mark.parametrize(("model", "upper", "below"), FULL_CELLS)
def test_full_cells(model, upper, below):
    assert fits(model, "full", upper)
    assert not fits(model, "full", below)


UPPER_BOUNDS = ([(m, mode, u, False) for m, u, _ in LORA_CELLS for mode in ("lora", "qlora")]
                + [(m, "full", u, False) for m, u, _ in FULL_CELLS]
                + [("qwen3-4b-base", "full", "1xH100", True), ("qwen3-4b-base", "full", "2xL40S", True)])
"""Every cell's upper bound (Qwen3-4B full: with the optimizer on CPU, see below)."""


@pytest.mark.parametrize(("model", "mode", "upper", "offload"), UPPER_BOUNDS)
def test_every_upper_bound_fits_at_2048_tokens(model, mode, upper, offload):
    assert fits(model, mode, upper, offload=offload, max_tokens=2048)


def test_activations_follow_the_micro_batch_budget_and_the_logit_chunk():
    p = preset("qwen3-8b-base")
    base = plan(p, "lora", "1xH100", max_tokens=2048)
    # one micro-batch of the learner's budget (8,192 tokens), not the whole group (16,384)
    assert base.micro_batch_tokens == 8192 and base.logit_chunk_tokens == 1024
    half = plan(p, "lora", "1xH100", max_tokens=2048, micro_batch_tokens=4096)
    layer = 2 * p.hidden * p.layers + 34 * p.hidden + 5 * p.heads * 2048  # bf16 checkpointed, per token
    assert base.activations_checkpointed - half.activations_checkpointed == pytest.approx(4096 * layer / 1e9)
    # the logits of one chunk: 12 bytes per value (fp32 log-softmax, its gradient, the logits' gradient)
    wide = plan(p, "lora", "1xH100", max_tokens=2048, logit_chunk_tokens=2048)
    assert wide.activations - base.activations == pytest.approx(12 * 1024 * p.vocab / 1e9)
    assert base.activations_checkpointed - 8192 * layer / 1e9 == pytest.approx(12 * 1024 * p.vocab / 1e9)
    # a chunk is never more than the micro-batch; a sequence over the budget is a micro-batch of its own
    small = plan(p, "lora", "1xH100", max_tokens=512, micro_batch_tokens=256, logit_chunk_tokens=4096)
    assert small.activations_checkpointed == pytest.approx(
        512 * (2 * p.hidden * p.layers + 34 * p.hidden + 5 * p.heads * 512) / 1e9 + 12 * 512 * p.vocab / 1e9)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan(p, "lora", "1xH100", micro_batch_tokens=0)


def test_qwen3_4b_full_needs_optimizer_offload_on_80gb():
    # 16 bytes/param of learner state (64 GB) + 8 GB of rollout weights leave no room on
    # one 80 GB GPU; the table's 1x80 GB and 2x48 GB hold with the optimizer on CPU.
    assert not fits("qwen3-4b-base", "full", "1xH100")
    assert fits("qwen3-4b-base", "full", "1xH100", offload=True)
    assert fits("qwen3-4b-base", "full", "2xL40S", offload=True)
    assert not fits("qwen3-4b-base", "full", "1xL40S")
    assert not fits("qwen3-4b-base", "full", "2xL4")


def test_moe_full_needs_more_than_eight():
    # At 8x80 GB ZeRO-3 the learner state is 61 GB/GPU and the rollout weights 7.6 GB, and the
    # optimizer step's transients (30 GB) come on top: 101 GB against a 72 GB budget; 16 fit.
    assert not fits("qwen3-30b-a3b-base", "full", "8xH100")
    assert fits("qwen3-30b-a3b-base", "full", "8xH100", offload=True)


@pytest.mark.parametrize(
    ("model", "mode", "low", "high"),
    [
        ("qwen3-4b-base", "lora", 1, 1), ("qwen3-8b-base", "lora", 1, 1), ("olmo-3-1025-7b", "lora", 1, 1),
        ("qwen3-14b-base", "lora", 1, 2), ("qwen3-30b-a3b-base", "lora", 2, 4), ("olmo-3-1125-32b", "lora", 4, 4),
        ("qwen3-4b-base", "full", 1, 2), ("qwen3-8b-base", "full", 2, 4), ("olmo-3-1025-7b", "full", 2, 4),
        ("qwen3-14b-base", "full", 4, 8), ("qwen3-30b-a3b-base", "full", 8, 16), ("olmo-3-1125-32b", "full", 8, 16),
    ],
)
def test_smallest_fit_on_80gb_is_within_the_table(model, mode, low, high):
    best = smallest_fit(preset(model), mode, "H100", colocated=True)
    assert best is not None and best.fits
    assert low <= best.gpus <= high, best.label


@pytest.mark.parametrize(("model", "mode", "upper"), [(m, "lora", u) for m, u, _ in LORA_CELLS]
                         + [(m, "full", u) for m, u, _ in FULL_CELLS])
def test_separate_rollout_gpus_never_need_more_learner_gpus(model, mode, upper):
    # with vLLM on its own GPUs the learner's share is smaller: it fits within the cell's count, and one
    # rollout replica needs at most two GPUs (the 32B policy's 64 GB of weights do not fit vLLM's 68 GB
    # share of one 80 GB GPU with the KV cache)
    p = preset(model)
    best = smallest_fit(p, mode, "H100")
    assert best is not None and not best.colocated and best.gpus <= parse_gpus(upper)[1], best.label
    assert best.rollout_gpus == (2 if model == "olmo-3-1125-32b" else 1)


def test_components_follow_the_zero_stage():
    p = preset("qwen3-8b-base")
    z0, z1, z2, z3 = (plan(p, "full", "4xH100", zero_stage=z) for z in range(4))
    assert z0.optimizer == pytest.approx(12 * p.params / 1e9)
    assert z1.optimizer == pytest.approx(z0.optimizer / 4) and z1.gradients == z0.gradients
    assert z2.gradients == pytest.approx(z0.gradients / 4) and z2.weights == z0.weights
    assert z3.weights == pytest.approx(z0.weights / 4)
    assert plan(p, "full", "4xH100", offload=True).optimizer == 0
    # checkpointing saves memory; a reference model costs a weight copy for full, nothing for LoRA
    assert z3.activations_checkpointed < z3.activations_full
    assert plan(p, "full", "4xH100", beta=0.04).reference == pytest.approx(z3.weights)
    assert plan(p, "lora", "1xH100", beta=0.04).reference == 0
    learner = ("weights", "gradients", "optimizer", "reference")
    step_or_activations = max(z3.activations, z3.optimizer_step)
    # as deployed: the learner's GPUs hold the learner alone, one rollout GPU its weights and KV cache
    assert z3.runtime == 2.0 and z3.total == pytest.approx(sum(getattr(z3, k) for k in learner) + step_or_activations
                                                           + z3.runtime)
    assert (z3.colocated, z3.rollout_gpus, z3.rollout_weights) == (False, 1, pytest.approx(2 * p.params / 1e9))
    assert z3.rollout == pytest.approx(z3.rollout_weights + z3.kv_cache + z3.runtime)
    assert z3.rollout_budget == pytest.approx(0.85 * 80)  # vLLM's gpu_memory_utilization of the rollout GPU
    # colocated: vLLM tensor-parallel over the learner's 4 GPUs, everything on each of them
    shared = plan(p, "full", "4xH100", zero_stage=3, colocated=True)
    assert shared.rollout_weights == pytest.approx(z3.rollout_weights / 4) and shared.rollout_gpus == 4
    assert shared.total == pytest.approx(sum(getattr(shared, k) for k in (*learner, "rollout_weights", "kv_cache"))
                                         + step_or_activations + shared.runtime)
    with pytest.raises(ValueError, match="colocated"):
        plan(p, "full", "4xH100", colocated=True, rollout_gpus="1xH100")
    assert z3.optimizer_step == pytest.approx(8 * z3.gradients / 2)  # fp32 gradient copy + sqrt(v) + eps, sharded
    # QLoRA: NF4 linear layers (0.516 bytes/param with block constants), bf16 embedding and head
    emb = 151936 * 4096 * 2
    assert plan(p, "qlora", "1xH100").rollout_weights == pytest.approx(((p.params - emb) * 0.516 + emb * 2) / 1e9)


def test_lora_trains_only_the_attention_adapter():
    # rank 8 on q, k, v, o (the learner's defaults): 36 layers x 8 x (8192 + 2 x 5120 + 8192)
    lora = plan(preset("qwen3-8b-base"), "lora", "1xH100")
    assert lora.optimizer == pytest.approx(12 * 36 * 8 * 26624 / 1e9)
    assert lora.gradients == pytest.approx(2 * 36 * 8 * 26624 / 1e9)


def test_kv_cache_per_token():
    p = preset("qwen3-8b-base")  # 36 layers, 8 KV heads of 128: 147,456 bytes per token
    kv = plan(p, "lora", "1xH100", group_size=4, max_tokens=1000, groups_in_flight=3, rollout_gpus="2xH100").kv_cache
    assert kv == pytest.approx(2 * 36 * 8 * 128 * 2 * 3 * 4 * 1000 / 2 / 1e9)


def test_presets_and_lookup():
    assert len(PRESETS) == 6
    assert preset("qwen3-8b-base") is preset("Qwen/Qwen3-8B-Base")
    moe = preset("QWEN3-30B-A3B-BASE")
    assert (moe.experts, moe.experts_per_token, moe.active_params < moe.params) == (128, 8, True)
    with pytest.raises(ValueError, match="valid: Qwen3-4B-Base.*OLMo-3-1125-32B"):
        preset("llama-3-8b")


def test_parse_gpus():
    assert parse_gpus("8xH100") == parse_gpus("H100:8") == ("H100", 8)
    assert parse_gpus("a100-80gb:2") == ("A100-80GB", 2)
    assert parse_gpus("L40S") == ("L40S", 1)
    with pytest.raises(ValueError, match="unknown GPU type 'T4'"):
        parse_gpus("1xT4")
    with pytest.raises(ValueError, match="cannot read"):
        parse_gpus("2xH100:4")
    with pytest.raises(ValueError, match="offload needs"):
        plan(preset("qwen3-4b-base"), Mode.full, "1xH100", zero_stage=0, offload=True)


runner = CliRunner()


def test_cli_exit_codes_and_json():
    base = ["plan", "--model", "qwen3-8b-base", "--mode", "full", "--max-tokens", "1024", "--group-size", "8"]
    ok = runner.invoke(app, [*base, "--gpus", "4xH100"])
    assert ok.exit_code == 0, ok.output
    assert "optimizer" in ok.output and "fits" in ok.output
    no = runner.invoke(app, [*base, "--gpus", "H100:1", "--no-offload", "--json"])
    assert no.exit_code == 2, no.output
    out = json.loads(no.output)
    assert out["fits"] is False and out["gpus"] == 1 and out["total"] > out["budget"] == 72.0
    assert (out["pinned"], out["offload"]) == (["--no-offload"], False)
    assert out["smallest_fit"] == "4xH100, ZeRO-2; rollout 1xH100 per server"
    assert out["fits_if_searched"] == "ZeRO-1, offload, vLLM tensor-parallel over 1"
    assert (out["rollout_gpus"], out["rollout_fits"], out["rollout_budget"]) == (1, True, 68.0)
    # offload left open, the search takes it: the optimizer state on CPU leaves one H100 enough
    searched = json.loads(runner.invoke(app, [*base, "--gpus", "H100:1", "--json"]).output)
    assert (searched["fits"], searched["zero_stage"], searched["offload"], searched["pinned"]) == (True, 1, True, [])
    # a 32B policy does not fit one 80 GB rollout GPU (64 GB of weights, vLLM takes 85%): the search gives the
    # replica two; pinned to one, nothing fits at any learner size, and the answer says what would
    olmo = ["plan", "--model", "olmo-3-1125-32b", "--mode", "lora", "--gpus", "2xH100", "--zero-stage", "3", "--json"]
    two = runner.invoke(app, olmo)
    assert two.exit_code == 0 and (json.loads(two.output)["rollout_gpus"], json.loads(two.output)["fits"]) == (2, True)
    one = json.loads(runner.invoke(app, [*olmo, "--rollout-gpus", "1xH100"]).output)
    assert (one["rollout_fits"], one["fits"], one["smallest_fit"]) == (False, False, None)
    assert one["fits_if_searched"] == "ZeRO-3, no offload, vLLM tensor-parallel over 2"
    # without checkpointing every layer's activations stay: 8B LoRA no longer fits on one H100
    lora = ["plan", "--model", "qwen3-8b-base", "--mode", "lora", "--gpus", "1xH100", "--json"]
    assert runner.invoke(app, lora).exit_code == 0
    full_acts = runner.invoke(app, [*lora, "--no-checkpointing"])
    assert full_acts.exit_code == 2
    assert json.loads(full_acts.output)["activations"] == json.loads(full_acts.output)["activations_full"]
    # the learner's micro-batch and logit chunk, by default its own defaults
    out = json.loads(runner.invoke(app, [*lora, "--max-tokens", "2048"]).output)
    assert (out["micro_batch_tokens"], out["logit_chunk_tokens"], out["fits"]) == (8192, 1024, True)
    big = runner.invoke(app, [*lora, "--max-tokens", "2048", "--micro-batch-tokens", "65536",
                              "--logit-chunk-tokens", "65536"])
    assert big.exit_code == 2 and json.loads(big.output)["logit_chunk_tokens"] == 65536


def test_cli_errors_name_the_valid_choices():
    bad_model = runner.invoke(app, ["plan", "--model", "gpt-5", "--gpus", "1xH100"])
    assert bad_model.exit_code == 1 and "valid: Qwen3-4B-Base" in bad_model.output
    bad_gpu = runner.invoke(app, ["plan", "--model", "qwen3-4b-base", "--gpus", "2xV100"])
    assert bad_gpu.exit_code == 1 and "unknown GPU type 'V100'" in bad_gpu.output


ANSWER = re.compile(r"fits: (\d+)x(\S+), ZeRO-(\d), (no offload|offload), vLLM tensor-parallel over (\d+)")
"""``tandem plan``'s line for a fit: the GPUs, and the stage, offload and tensor-parallel size it found."""


def answer(*args: str) -> tuple[int, str]:
    """``tandem plan``'s exit code and its text output, rich's line wrapping undone."""
    result = runner.invoke(app, ["plan", *args])
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(("model", "mode", "upper", "offload"), UPPER_BOUNDS)
def test_cli_finds_a_fit_for_every_upper_bound_at_2048_tokens(model, mode, upper, offload):
    # issue 33: the CLI tried only the default ZeRO stage (2 for LoRA on several GPUs) and said "does not fit"
    # where another stage fits; left open, the stage, offload (Qwen3-4B full) and vLLM's TP are searched
    code, out = answer("--model", model, "--mode", mode, "--gpus", upper, "--colocated", "--max-tokens", "2048")
    assert code == 0 and "does not fit" not in out, out
    m = ANSWER.search(out)
    assert m, out
    n, gpu, z, off, tp = m.groups()
    assert f"{n}x{gpu}" == upper and int(tp) == int(n)  # colocated: vLLM over all the run's GPUs
    assert (off == "offload") == offload
    named = plan(preset(model), mode, upper, zero_stage=int(z), offload=off == "offload", colocated=True,
                 max_tokens=2048)
    assert named.fits and f"{named.total:.1f}" in out


def test_cli_olmo_32b_lora_on_four_h100_fits_at_zero_3():
    # the reported case: ZeRO-2 (LoRA's default on several GPUs) keeps the 64 GB base whole on every GPU
    args = ["--model", "OLMo-3-1125-32B", "--mode", "lora", "--gpus", "4xH100", "--colocated", "--max-tokens", "2048"]
    code, out = answer(*args)
    assert code == 0 and "does not fit" not in out, out
    assert "fits: 4xH100, ZeRO-3, no offload, vLLM tensor-parallel over 4" in out
    # pinned to ZeRO-2 it does not fit, and the answer says the stage is what stands in the way, not the GPUs
    code, out = answer(*args, "--zero-stage", "2")
    assert code == 2, out
    assert "without --zero-stage it fits here: ZeRO-3, no offload, vLLM tensor-parallel over 4" in out
    assert "smallest that fits" not in out and "no fit up to 16xH100 with --zero-stage as given" in out


@pytest.mark.parametrize(("model", "mode", "gpus", "pin"), [
    ("olmo-3-1125-32b", "full", "2xH100", []),
    ("qwen3-30b-a3b-base", "lora", "1xH100", []),
    ("qwen3-14b-base", "lora", "1xL40S", []),
    ("qwen3-8b-base", "lora", "1xL4", []),
    ("qwen3-30b-a3b-base", "full", "8xH100", ["--no-offload"]),  # test_moe_full_needs_more_than_eight
    ("qwen3-8b-base", "full", "3xH100", ["--no-offload"]),  # a count smallest_fit does not try
])
def test_cli_a_real_non_fit_names_more_gpus(model, mode, gpus, pin):
    args = ["--model", model, "--mode", mode, "--gpus", gpus, "--colocated", "--max-tokens", "2048", *pin]
    code, out = answer(*args)
    assert code == 2 and ANSWER.search(out) is None, out
    given = parse_gpus(gpus)
    m = re.search(r"does not fit on (\S+).*; smallest that fits: (\d+)x(\S+), ZeRO-(\d)", out)
    assert m and m.group(1) == gpus, out
    assert m.group(3).rstrip(",") == given[0] and int(m.group(2)) > given[1], out
    # the search on the given GPUs really found nothing: every stage (and offload unless pinned off) misses
    assert not any(c.fits for c in candidates(preset(model), mode, gpus, colocated=True, max_tokens=2048,
                                              offload=False if pin else None))
    smallest = json.loads(runner.invoke(app, ["plan", *args, "--json"]).output)["smallest_fit"]
    assert parse_gpus(smallest.split(",")[0])[1] > given[1]
