"""Batch building, validation, rank split and micro-batch packing (learner.batch)."""

from __future__ import annotations

import pytest
import torch

from learner.batch import TrainSeq, bucket, build_batch, check_group, collate, pack, split_ranks
from services.config import LossConfig
from services.wire import ScoredSample, TrajectoryGroup


def sample(tokens, reward, finish="stop"):
    return ScoredSample(token_ids=tokens, logprobs=[-1.0] * len(tokens), text="", finish_reason=finish,
                        policy_version=0, reward=reward, status="ok")


def group(gid, samples, prompt=(5, 6)):
    return TrajectoryGroup(run_id="r", group_id=gid, prompt="", prompt_token_ids=list(prompt), samples=samples,
                           n=len(samples), policy_version=0)


def test_build_batch_advantages_and_token_mean_weights():
    g = group("a", [sample([7, 8], 1.0), sample([9], 0.0)])
    rows = build_batch([g], LossConfig(advantage="dr_grpo", aggregation="token_mean"), max_tokens=16)
    assert [r.advantage for r in rows] == pytest.approx([0.5, -0.5])
    assert [r.coef for r in rows] == pytest.approx([1 / 3, 1 / 3])
    assert rows[0].prompt == (5, 6) and rows[0].completion == (7, 8)


def test_overlong_completions_are_dropped_after_advantages():
    g = group("a", [sample([7, 8], 1.0, "length"), sample([9], 0.0), sample([9, 9, 9], 0.5)])
    cfg = LossConfig(advantage="dr_grpo", aggregation="token_sum_norm", drop_overlong=True)
    rows = build_batch([g], cfg, max_tokens=10)
    # the baseline still uses all three rewards (mean 0.5); the overlong row is gone
    assert [r.advantage for r in rows] == pytest.approx([-0.5, 0.0])
    assert [r.coef for r in rows] == pytest.approx([1 / 20, 1 / 20])  # max_tokens x rows
    rows = build_batch([g], cfg.model_copy(update={"drop_overlong": False, "norm_tokens": 7}), max_tokens=10)
    assert len(rows) == 3 and rows[0].coef == pytest.approx(1 / 7)


def test_check_group_reasons():
    assert check_group(group("a", [sample([7], 1.0), sample([8], 0.0)]), vocab_size=10, max_len=8) is None
    assert "vocab" in check_group(group("a", [sample([7], 1.0), sample([12], 0.0)]), 10, 8)
    assert "prompt token" in check_group(group("a", [sample([7], 1.0)], prompt=(50,)), 10, 8)
    assert "over the model" in check_group(group("a", [sample([7] * 9, 1.0)]), 10, 8)


def test_collate_aligns_targets_with_logits():
    row = TrainSeq("g", (5, 6), (7, 8, 9), (-0.1, -0.2, -0.3), 2.0, 0.25)
    short = TrainSeq("g", (5,), (4,), (-0.5,), -1.0, 0.5)
    b = collate([row, short], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b["targets"].tolist() == [[6, 7, 8, 9], [4, 0, 0, 0]]
    assert b["mask"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert b["behav"][0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert b["coef"][1].tolist() == pytest.approx([0.5, 0, 0, 0])
    assert b["advantages"].tolist() == [2.0, -1.0]
    dummy = collate([], pad_id=0)
    assert dummy["mask"].sum() == 0


def test_bucket_keeps_the_padded_size_within_the_budget():
    rows = [TrainSeq(f"g{i}", (1,) * 2, (2,) * n, (-1.0,) * n, 0.0, 1.0) for i, n in enumerate([8, 2, 3, 1, 6])]
    mbs = bucket(rows, budget_tokens=20)
    assert sorted(r.group_id for mb in mbs for r in mb) == sorted(r.group_id for r in rows)
    for mb in mbs:
        assert len(mb) == 1 or len(mb) * max(r.length for r in mb) <= 20
    assert len(bucket(rows, budget_tokens=4)) == 5  # over-long rows get a micro-batch each


def test_pack_counts_real_tokens_and_fills_micro_batches_first_fit():
    # lengths 10, 4, 5, 3, 8 (prompt 2): 30 tokens fit two budgets of 16 exactly when packed
    rows = [TrainSeq(f"g{i}", (1,) * 2, (2,) * n, (-1.0,) * n, 0.0, 1.0) for i, n in enumerate([8, 2, 3, 1, 6])]
    mbs = pack(rows, budget_tokens=16)
    assert [[r.length for r in mb] for mb in mbs] == [[10, 5], [8, 4, 3]]  # first fit, longest first
    assert [[r.length for r in mb] for mb in bucket(rows, 16)] == [[10], [8, 5], [4, 3]]  # padded: three
    assert sorted(r.group_id for mb in mbs for r in mb) == sorted(r.group_id for r in rows)
    assert [len(mb) for mb in pack(rows, budget_tokens=4)] == [1] * 5  # over-long rows get a micro-batch each
    assert pack(rows, 16) == mbs and pack([], 16) == []


def test_packed_collate_is_one_row_with_positions_restarting_per_sequence():
    row = TrainSeq("g", (5, 6), (7, 8, 9), (-0.1, -0.2, -0.3), 2.0, 0.25)
    short = TrainSeq("g", (5,), (4,), (-0.5,), -1.0, 0.5)
    padded, packed = collate([row, short], pad_id=0), collate([row, short], pad_id=0, packed=True)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 5, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed["seq_lens"] == (5, 2) and "attention_mask" not in packed
    # the loss's tensors are the padded layout's, whatever the model's input
    for key in ("targets", "mask", "behav", "coef", "advantages", "tokens"):
        assert torch.equal(packed[key], padded[key]), key
    assert packed["tokens"].tolist() == [7, 8, 9, 4]
    # the output at each index predicts the token: position 1 (6 -> 7) ... and row 2's position 0 (5 -> 4)
    assert packed["index"].tolist() == [1, 2, 3, 5]
    assert padded["index"].tolist() == [1, 2, 3, 5]  # row 2 starts at 5 in the [2, 5] padded input too
    three = collate([short, short, row], pad_id=0, packed=True)
    assert three["index"].tolist() == [0, 2, 5, 6, 7]
    assert collate([short, short, row], pad_id=0)["index"].tolist() == [0, 5, 11, 12, 13]
    dummy = collate([], pad_id=0, packed=True)
    assert dummy["mask"].sum() == 0 and dummy["index"].numel() == 0 and dummy["seq_lens"] == (2,)


def test_split_ranks_balances_tokens_deterministically():
    rows = [TrainSeq(f"g{i}", (1,), (2,) * n, (-1.0,) * n, 0.0, 1.0) for i, n in enumerate([9, 1, 5, 5, 2, 2])]
    a, b = split_ranks(rows, 2)
    assert sorted(r.group_id for r in a + b) == sorted(r.group_id for r in rows)
    assert abs(sum(r.length for r in a) - sum(r.length for r in b)) <= 2
    assert split_ranks(rows, 2) == [a, b]
    assert split_ranks(rows, 1) == [sorted(rows, key=lambda r: (-r.length, r.group_id, r.completion))]


def test_collate_marks_the_model_tokens_drawn_before_min_tokens():
    """``held``: a completion's first min_tokens tokens; an episode counts its model tokens over its turns
    (observation tokens are not scored and not counted), as rollout_server.episodes asks vLLM for them."""
    plain = TrainSeq("g", (5,), (7, 8, 9, 10), (0.0,) * 4, 0.0, 0.0)
    episode = TrainSeq("g", (5,), (7, 8, 1, 1, 9, 9), (0.0,) * 6, 0.0, 0.0, (1, 1, 0, 0, 1, 1))
    b = collate([plain, episode], pad_id=0, min_tokens=3)
    assert b["tokens"].tolist() == [7, 8, 9, 10, 7, 8, 9, 9]
    assert b["held"].tolist() == [True, True, True, False, True, True, True, False]
    assert "held" not in collate([plain], pad_id=0)
    assert collate([], pad_id=0, min_tokens=3)["held"].tolist() == []


def test_held_rows_exclude_the_end_tokens_as_vllms_sampler_does():
    """On held rows the log-probs are of softmax(logits / T) with the stop tokens masked (renormalised over
    the rest); other rows keep the whole distribution; entropy and gradients stay finite."""
    from learner.logits import scored_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 6, bias=False)
    hidden = torch.randn(1, 5, 8)
    index, targets = torch.arange(4), torch.tensor([3, 1, 0, 4])
    held, stops = torch.tensor([True, True, True, False]), torch.tensor([0, 2])
    lp, ent = scored_logprobs(hidden, head, index, targets, temperature=0.7, chunks=2, entropy="grad",
                              held=held, stops=stops)
    logits = head(hidden[0, :4]) / 0.7
    masked = logits.clone()
    masked[:2, [0, 2]] = float("-inf")  # row 2's own token is a stop token: it was not drawn under the mask
    want = torch.log_softmax(masked, -1).gather(-1, targets[:, None])[:, 0]
    assert lp.tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert lp[3].item() == pytest.approx(torch.log_softmax(logits[3], -1)[4].item(), abs=1e-6)
    assert torch.isfinite(ent).all()
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(head.weight.grad).all()
