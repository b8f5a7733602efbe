"""An episode's observation tokens are read, never trained (learner.batch with learner.loss), on a tiny Qwen3.

One episode row (prompt P; completion: the model's m1, a tool's observation o, the model's m2; mask
1..1 0..0 1..1) must give exactly the loss, statistics and gradient of two ordinary rows that hold the
same model tokens as completions: (P, m1) and (P + m1 + o, m2), o then being prompt. So the observation
tokens get no gradient and count in neither the KL, the entropy, nor the token count; their behaviour
log-probs (0 on the wire) do not matter.
"""

from __future__ import annotations

import pytest
import torch

from learner.batch import TrainSeq, build_batch, collate
from learner.logits import scored_logprobs, spread
from learner.loss import token_loss
from services.config import LossConfig
from services.wire import ScoredSample, TrajectoryGroup

TOL = 1e-5
TEMPERATURE = 0.7
LOSS = LossConfig(off_policy="tis", beta=0.05, entropy_coef=0.01, eps_low=0.2, eps_high=0.28)


def loss_and_grads(model, seqs: list[TrainSeq], packed: bool):
    batch = collate(seqs, pad_id=model.config.pad_token_id, packed=packed)
    model.zero_grad(set_to_none=True)
    kw = ({"position_ids": batch["position_ids"]} if packed else {"attention_mask": batch["attention_mask"]})
    if packed:  # one sequence per row here: the packed layout of a single row is the row itself
        assert len(seqs) == 1
    out = model(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=1, output_hidden_states=True, **kw)
    logp, ent = scored_logprobs(out.hidden_states[-1], model.get_output_embeddings(), batch["index"], batch["tokens"],
                                temperature=TEMPERATURE, chunks=2, entropy="grad")
    logp, ent = spread(logp, batch["mask"]), spread(ent, batch["mask"])
    ref = logp.detach() - 0.1 * batch["mask"]  # a reference policy a little off, on the scored tokens
    loss, stats = token_loss(LOSS, logp=logp, behav_logp=batch["behav"], advantages=batch["advantages"],
                             mask=batch["mask"], coef=batch["coef"], ref_logp=ref, entropy=ent)
    loss.backward()
    return loss.item(), stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)


@pytest.mark.slow  # over 5 s in make test-fast (docs/testing.md): make test runs it
def test_observation_tokens_get_no_gradient_and_no_count(model):
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    p, m1, o, m2 = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 6, 5, 7))
    behav1, behav2 = (-torch.rand(n, generator=g) * 3 for n in (6, 7))
    coef = 1 / 13  # token_mean over the 13 model tokens
    episode = TrainSeq("g", tuple(p), tuple(m1 + o + m2), tuple([*behav1.tolist(), *[0.0] * 5, *behav2.tolist()]),
                       1.5, coef, trained=tuple([1] * 6 + [0] * 5 + [1] * 7))
    split = [TrainSeq("g", tuple(p), tuple(m1), tuple(behav1.tolist()), 1.5, coef),
             TrainSeq("g", tuple(p + m1 + o), tuple(m2), tuple(behav2.tolist()), 1.5, coef)]
    loss_e, st_e, g_e = loss_and_grads(model, [episode], packed=False)
    loss_s, st_s, g_s = loss_and_grads(model, split, packed=False)
    assert st_e.tokens == st_s.tokens == 13
    assert loss_e == pytest.approx(loss_s, rel=TOL)
    for name in ("pg_loss", "kl_sum", "entropy_sum", "is_weight_sum"):
        assert getattr(st_e, name) == pytest.approx(getattr(st_s, name), rel=TOL, abs=1e-9), name
    assert st_e.kl_sum > 0 and st_e.entropy_sum > 0
    assert sorted(g_e) == sorted(g_s)
    worst = max(g_e, key=lambda n: rel(g_e[n], g_s[n]))
    assert rel(g_e[worst], g_s[worst]) < TOL, worst
    # the packed layout gives the same
    loss_p, st_p, g_p = loss_and_grads(model, [episode], packed=True)
    assert loss_p == pytest.approx(loss_e, rel=TOL) and st_p.tokens == 13
    # the observation's behaviour log-probs mean nothing
    noisy = TrainSeq("g", episode.prompt, episode.completion,
                     tuple(b if t else -7.0 for b, t in zip(episode.behav, episode.trained, strict=True)),
                     1.5, coef, trained=episode.trained)
    assert loss_and_grads(model, [noisy], packed=False)[0] == loss_e


def test_an_episode_sample_becomes_a_row_weighted_by_its_model_tokens():
    def sample(n_model: int, n_obs: int, reward: float) -> ScoredSample:
        n = n_model + n_obs
        return ScoredSample(token_ids=[7] * n, logprobs=[-1.0] * n_model + [0.0] * n_obs, text="", finish_reason="stop",
                            policy_version=0, reward=reward, status="ok",
                            mask=[1] * n_model + [0] * n_obs if n_obs else [])
    g = TrajectoryGroup(run_id="r", group_id="a", prompt="", prompt_token_ids=[5], n=3, policy_version=0,
                        samples=[sample(2, 4, 1.0), sample(3, 0, 0.0), ScoredSample(
                            token_ids=[7, 7], logprobs=[0.0, 0.0], text="", finish_reason="stop", policy_version=0,
                            reward=0.5, status="ok", mask=[0, 0])])
    rows = build_batch([g], LossConfig(advantage="dr_grpo", aggregation="token_mean"), max_tokens=16)
    assert len(rows) == 2  # a completion of observations only has nothing to train
    assert rows[0].trained == (1, 1, 0, 0, 0, 0) and rows[1].trained is None
    assert [r.scored for r in rows] == [2, 3] and [r.coef for r in rows] == pytest.approx([1 / 5, 1 / 5])
    rows = build_batch([g], LossConfig(advantage="dr_grpo", aggregation="seq_mean_token_mean"), max_tokens=16)
    assert [r.coef for r in rows] == pytest.approx([1 / (2 * 2), 1 / (2 * 3)])
    batch = collate(rows, pad_id=0)
    assert batch["mask"].sum() == 5 and batch["index"].numel() == 5
