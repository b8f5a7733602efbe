"""Padding-free micro-batches (learner.packing, learner.batch.pack) against padded ones.

On the tiny Qwen3 the packed row (one row, positions restarting per sequence,
the learner's per-sequence attention) must give each sequence the log-probs,
and the batch the loss and gradients, of the padded path the seed learner
used (one right-padded row per sequence, transformers' SDPA) within float
rounding (``TOL``); so must a sliding-window layer. Then the learner's engine
(DeepSpeed, ``tests.selfcheck``): packed or padded micro-batches, whole or
3-token logit chunks, ZeRO-0 or ZeRO-3, one rank or two, all make the same
update (``REL``, the engine tests' tolerance).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from learner.batch import TrainSeq, collate
from learner.logits import scored_logprobs, spread
from learner.loss import token_loss
from learner.packing import ATTENTION, packing_error, register
from services.config import LossConfig

TOL = 1e-5
"""Largest |packed - padded| / max|padded| (log-probs, loss, each gradient): the same arithmetic but
attention over a sequence's own slice instead of a padded row, so only rounding differs."""
REL = 1e-3
"""As tests/integration/learner/test_engine.py: relative difference of two updates (trained - initial)."""
LOSS = LossConfig(off_policy="tis", beta=0.0, entropy_coef=0.01, policy_loss="gspo")


def rows(vocab: int) -> list[TrainSeq]:
    """GRPO-like: a shared prompt per group, completions from 1 to 23 tokens; the third group's three of one
    length (adjoining, as the learner packs them) take the batched path of the packed attention."""
    g = torch.Generator().manual_seed(3)
    out = []
    for gid, (p, lengths) in enumerate([(4, [23, 2, 9, 1]), (7, [5, 14, 3, 11]), (5, [8, 8, 8, 2])]):
        prompt = tuple(torch.randint(3, vocab, (p,), generator=g).tolist())
        for c in lengths:
            out.append(TrainSeq(f"g{gid}", prompt, tuple(torch.randint(3, vocab, (c,), generator=g).tolist()),
                                tuple((-torch.rand(c, generator=g) * 4).tolist()), 1.0 if c % 2 else -1.0, 1 / 68))
    return out


def load(path, packed: bool, **config):
    from transformers import AutoModelForCausalLM

    attention = {"attn_implementation": register()} if packed else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **attention, **config)


def step(model, batch: dict, packed: bool):
    """Log-probs at the completion tokens, the loss and every gradient, as the engine computes them."""
    model.zero_grad(set_to_none=True)
    if packed:
        shape = {"position_ids": batch["position_ids"], "packed_seq_lens": batch["seq_lens"]}
    else:
        shape = {"attention_mask": batch["attention_mask"]}
    out = model(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=1, output_hidden_states=True, **shape)
    logp, ent = scored_logprobs(out.hidden_states[-1], model.get_output_embeddings(), batch["index"], batch["tokens"],
                                temperature=1.0, chunks=2, entropy="grad")
    logp, ent = spread(logp, batch["mask"]), spread(ent, batch["mask"])
    loss, _ = token_loss(LOSS, logp=logp, behav_logp=batch["behav"], advantages=batch["advantages"],
                         mask=batch["mask"], coef=batch["coef"], entropy=ent)
    loss.backward()
    return logp.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_packed_equals_padded(path, **config) -> None:
    seqs = rows(load(path, False).config.vocab_size)
    padded_batch, packed_batch = collate(seqs, pad_id=0), collate(seqs, pad_id=0, packed=True)
    assert packed_batch["input_ids"].numel() == sum(s.length for s in seqs) < padded_batch["input_ids"].numel()
    lp_pad, loss_pad, g_pad = step(load(path, False, **config), padded_batch, packed=False)
    lp_pack, loss_pack, g_pack = step(load(path, True, **config), packed_batch, packed=True)
    mask = padded_batch["mask"].bool()
    for i in range(len(seqs)):  # each sequence's own log-probs
        assert rel(lp_pack[i][mask[i]], lp_pad[i][mask[i]]) < TOL, i
    assert loss_pack == pytest.approx(loss_pad, rel=TOL)
    assert sorted(g_pack) == sorted(g_pad) and len(g_pad) > 10
    worst = max(g_pad, key=lambda n: rel(g_pack[n], g_pad[n]))
    assert rel(g_pack[worst], g_pad[worst]) < TOL, worst


def test_packed_row_equals_padded_rows(tiny_model):
    check_packed_equals_padded(tiny_model)


def test_packed_row_keeps_a_sliding_window(tiny_model):
    """A sliding window of 6 tokens on the second layer (Qwen3's use_sliding_window; OLMo 3 has such layers):
    sequences longer than the window get the banded mask transformers builds for the padded rows."""
    check_packed_equals_padded(tiny_model, use_sliding_window=True, sliding_window=6,
                               layer_types=["full_attention", "sliding_attention"])


@pytest.mark.slow  # over 5 s in make test-fast (docs/testing.md): make test runs it
def test_the_start_up_check_accepts_the_packed_attention_and_refuses_cross_talk(tiny_model):
    model = load(tiny_model, True).eval()
    assert model.config._attn_implementation == ATTENTION
    assert packing_error(model, model.config.vocab_size, torch.device("cpu")) is None

    class DropsPackingInputs(torch.nn.Module):
        """A model whose forward ignores position ids and sequence lengths: one causal row."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, position_ids=None, packed_seq_lens=None, **kwargs):
            return self.inner(**kwargs)

    why = packing_error(DropsPackingInputs(model), model.config.vocab_size, torch.device("cpu"))
    assert why is not None and "differ" in why


def test_packed_attention_refuses_lengths_that_do_not_tile_the_row(tiny_model):
    model = load(tiny_model, True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="do not tile"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]]), use_cache=False, packed_seq_lens=(2, 3))


# -- the engine (DeepSpeed), packed and chunked against padded ---------------------------------------

KL = {"beta": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01}
"""Loss options that bring in the reference model's log-probs and the entropy's gradient."""


@pytest.fixture(scope="module")
def engine_runs(tiny_model, tmp_path_factory):
    from tests.fixtures.learner import run_selfcheck

    def run(name, stage, learner):
        return {"name": name, "stage": stage, "steps": 2, "overrides": {"learner": {"lr": 1e-2, **learner}, "loss": KL}}

    one = run_selfcheck(tiny_model, [
        run("padded", 0, {"packing": False, "logit_chunk_tokens": 100_000}),
        run("packed", 0, {}),
        run("chunked", 0, {"logit_chunk_tokens": 3}),
        run("zero3", 3, {"logit_chunk_tokens": 3}),
    ], tmp_path_factory.mktemp("packing-1"))
    two = run_selfcheck(tiny_model, [run("zero3", 3, {"logit_chunk_tokens": 3})], tmp_path_factory.mktemp("packing-2"),
                        nproc=2)
    return one | {"two_ranks": two["zero3"]}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.deepspeed
def test_packed_and_chunked_engines_make_the_padded_update(engine_runs, tiny_model):
    initial = load_file(tiny_model / "model.safetensors")
    base = load_file(engine_runs["padded"])
    stats = {k: json.loads(p.with_name(p.name + ".json").read_text()) for k, p in engine_runs.items()}
    assert stats["two_ranks"]["world"] == 2

    def rel_update(a):
        diff = sum(float(((a[k].double() - base[k].double()) ** 2).sum()) for k in a) ** 0.5
        return diff / sum(float(((base[k].double() - initial[k].double()) ** 2).sum()) for k in a) ** 0.5

    for name in ("packed", "chunked", "zero3", "two_ranks"):
        assert rel_update(load_file(engine_runs[name])) < REL, name
        for a, b in zip(stats[name]["stats"], stats["padded"]["stats"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), name
            assert a["tokens"] == b["tokens"]
            assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-9), name
            assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5), name
    assert stats["padded"]["stats"][1]["kl"] > 1e-7  # the reference model's log-probs count
