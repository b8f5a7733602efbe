"""The DeepSpeed engine on CPU: ZeRO-0/2/3 and 1 vs 2 ranks make the same update.

Each configuration trains the same two steps on the same synthetic batches
(``tests.selfcheck``) and publishes its full weights (ZeRO-3: gathered);
the weights and the step statistics must agree within float tolerance.
AdamW's first steps hide a wrong gradient *scale* (it normalises), so the
gradient norms DeepSpeed reports are compared too: a rank that averaged
instead of summed its share would change them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

REL = 1e-3
"""Allowed |update_a - update_b| / |update_a| (update = trained - initial weights, over all tensors).

Reduction order differs between stages and ranks; AdamW divides by sqrt(v),
so float noise in near-zero gradients becomes a visible share of a step for
those entries. Relative to the whole update it stays far below this bound;
a real mistake (a lost micro-batch, a wrong rank share) moves it by O(1)."""


def weights(path):
    return load_file(path)


def stats(path):
    return json.loads(path.with_name(path.name + ".json").read_text())


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def rel_update_diff(a: dict, b: dict, initial: dict) -> float:
    assert sorted(a) == sorted(b) == sorted(initial)
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5
    step = sum(float(((a[k].double() - initial[k].double()) ** 2).sum()) for k in a) ** 0.5
    return diff / step


@pytest.fixture(scope="module")
def initial(tiny_model):
    return load_file(tiny_model / "model.safetensors")


def test_zero_stages_make_the_same_update(one_rank_runs, initial):
    base = weights(one_rank_runs["zero0"])
    assert sorted(base) == sorted(initial)  # HF names, tied lm_head left out
    assert max_diff(base, initial) > 1e-3  # the steps did move the weights
    for stage in ("zero2", "zero3"):
        assert rel_update_diff(base, weights(one_rank_runs[stage]), initial) < REL, stage
    # ZeRO-3 with optimizer and parameter offload and activation checkpointing: same update
    assert rel_update_diff(base, weights(one_rank_runs["offload"]), initial) < REL
    s0, s2, s3 = (stats(one_rank_runs[k])["stats"] for k in ("zero0", "zero2", "zero3"))
    for a, b in zip(s0, s3, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["tokens"] == b["tokens"]
    assert [x["grad_norm"] for x in s2] == pytest.approx([x["grad_norm"] for x in s3], rel=1e-5)


def test_two_ranks_make_the_same_update_as_one(one_rank_runs, two_rank_runs, initial):
    base = weights(one_rank_runs["zero0"])
    one = {k: stats(one_rank_runs[k]) for k in ("zero2", "zero3", "kl3")}
    for name in ("zero2", "zero3"):
        two = stats(two_rank_runs[name])
        assert two["world"] == 2
        assert rel_update_diff(base, weights(two_rank_runs[name]), initial) < REL, name
        assert [x["grad_norm"] for x in two["stats"]] == pytest.approx(
            [x["grad_norm"] for x in one[name]["stats"]], rel=1e-5
        )
        assert [x["loss"] for x in two["stats"]] == pytest.approx([x["loss"] for x in one[name]["stats"]], abs=1e-6)
    assert rel_update_diff(weights(one_rank_runs["kl3"]), weights(two_rank_runs["kl3"]), initial) < REL
    assert [x["kl"] for x in stats(two_rank_runs["kl3"])["stats"]] == pytest.approx(
        [x["kl"] for x in one["kl3"]["stats"]], rel=1e-4, abs=1e-9
    )


def test_reference_model_kl_and_entropy(one_rank_runs, initial):
    kl0, kl3 = stats(one_rank_runs["kl0"])["stats"], stats(one_rank_runs["kl3"])["stats"]
    # step 1: the policy is the reference, KL is 0; step 2: it moved away, KL > 0
    assert kl0[0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert kl0[1]["kl"] > 1e-7
    assert kl0[1]["entropy"] > 0
    # a ZeRO-3-sharded reference gives the same KL as a replicated one
    assert [x["kl"] for x in kl3] == pytest.approx([x["kl"] for x in kl0], rel=1e-4, abs=1e-9)
    assert rel_update_diff(weights(one_rank_runs["kl0"]), weights(one_rank_runs["kl3"]), initial) < REL
    # the KL and entropy terms change the update
    assert rel_update_diff(weights(one_rank_runs["kl0"]), weights(one_rank_runs["zero0"]), initial) > 10 * REL


def test_lora_publishes_merged_full_weights_or_the_adapter(one_rank_runs, tiny_model, initial):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = weights(one_rank_runs["lora"])
    assert sorted(merged) == sorted(initial)  # base names, no adapter tensors
    for k in initial:
        changed = not torch.equal(merged[k], initial[k])
        assert changed == (".q_proj." in k or ".v_proj." in k), k
    # adapter-only publishing: PEFT loads it onto the base model, and the result computes
    # what the merged full weights compute
    report = stats(one_rank_runs["lora"])
    ids = torch.tensor([report["probe"]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, report["adapter"])
    full = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    full.load_state_dict(merged, strict=False)
    with torch.no_grad():
        a = with_adapter(ids).logits
        b = full(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    lp = torch.log_softmax(b[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert lp.tolist() == pytest.approx(report["probe_logprobs"], abs=1e-4)


def test_bf16_trains(one_rank_runs, initial):
    out = weights(one_rank_runs["bf16"])
    st = stats(one_rank_runs["bf16"])["stats"][0]
    assert st["tokens"] > 0 and st["loss"] == st["loss"]  # not NaN
    assert max_diff(out, initial) > 1e-3
