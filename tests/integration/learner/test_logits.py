"""Log-probs a chunk of tokens at a time (learner.logits) against the full logits, on tiny Qwen3 models.

The full path is the seed learner's: the model's logits for every position,
divided by the temperature, then ``learner.loss.token_logprobs`` and
``token_entropy``. The chunked path takes the final hidden states at the
scored positions and applies the head in checkpointed chunks. Both feed
``token_loss``; the loss, the per-token values and every parameter's gradient
must agree within float rounding (``TOL``). A last test holds the chunked
path's peak memory to a few chunks' logits on a model with a 32k vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from learner.batch import TrainSeq, collate
from learner.logits import scored_logprobs, spread
from learner.loss import token_entropy, token_logprobs, token_loss
from services.config import LossConfig

TOL = 1e-5
"""Largest |a - b| / max|a| allowed between the two paths (loss, log-probs, each gradient): the same
float32 arithmetic on a subset of rows, so only summation order differs."""
TEMPERATURE = 0.7
LOSS = LossConfig(off_policy="tis", beta=0.0, entropy_coef=0.01, eps_low=0.2, eps_high=0.28)


def rows(vocab: int, seed: int = 0) -> list[TrainSeq]:
    """Completions of uneven lengths behind prompts of uneven lengths, random behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c) in enumerate([(3, 9), (5, 2), (2, 14), (4, 1), (6, 7)]):
        ids = torch.randint(3, vocab, (p + c,), generator=g).tolist()
        behav = (-torch.rand(c, generator=g) * 4).tolist()
        out.append(TrainSeq(f"g{i % 2}", tuple(ids[:p]), tuple(ids[p:]), tuple(behav), float(i % 3) - 1.0, 1 / 33))
    return out


def full_path(model, batch: dict):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1].float() / TEMPERATURE
    return token_logprobs(logits, batch["targets"]), token_entropy(logits)


def chunked_path(model, batch: dict, chunks: int):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                logits_to_keep=1, output_hidden_states=True)
    logp, ent = scored_logprobs(out.hidden_states[-1], model.get_output_embeddings(), batch["index"], batch["tokens"],
                                temperature=TEMPERATURE, chunks=chunks, entropy="grad")
    return spread(logp, batch["mask"]), spread(ent, batch["mask"])


def loss_and_grads(model, batch: dict, path):
    model.zero_grad(set_to_none=True)
    logp, ent = path(model, batch)
    loss, stats = token_loss(LOSS, logp=logp, behav_logp=batch["behav"], advantages=batch["advantages"],
                             mask=batch["mask"], coef=batch["coef"], entropy=ent)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    keep = batch["mask"].bool()
    return loss.item(), stats, logp.detach()[keep], ent.detach()[keep], grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_equal(model, chunks: int) -> None:
    batch = collate(rows(model.config.vocab_size), pad_id=model.config.pad_token_id)
    loss_f, st_f, lp_f, ent_f, g_f = loss_and_grads(model, batch, full_path)
    loss_c, st_c, lp_c, ent_c, g_c = loss_and_grads(model, batch, lambda m, b: chunked_path(m, b, chunks))
    assert lp_f.numel() == 33 == st_c.tokens
    assert loss_c == pytest.approx(loss_f, rel=TOL)
    assert rel(lp_c, lp_f) < TOL and rel(ent_c, ent_f) < TOL
    assert st_c.entropy_sum == pytest.approx(st_f.entropy_sum, rel=TOL)
    assert sorted(g_c) == sorted(g_f) and len(g_f) == len(list(model.parameters()))  # every weight, head included
    worst = max(g_f, key=lambda n: rel(g_c[n], g_f[n]))
    assert rel(g_c[worst], g_f[worst]) < TOL, worst


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    from examples.tiny import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("models") / "untied", seed=1, tie_embeddings=False)


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("chunks", [1, 4, 40])  # 40 > 33 tokens: some chunks are empty
def test_chunked_equals_full_logits_with_a_tied_head(tiny_model, chunks):
    model = load(tiny_model)
    assert model.config.tie_word_embeddings
    check_equal(model, chunks)


def test_chunked_equals_full_logits_with_its_own_head(untied_model):
    model = load(untied_model)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    check_equal(model, 3)


def test_chunked_equals_full_logits_under_lora(tiny_model):
    """peft wraps the model: the head is the base model's (learner.engine._output_head), the gradients
    reach the adapter's matrices only."""
    from peft import LoraConfig, get_peft_model

    from learner.engine import _output_head

    model = get_peft_model(load(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0, task_type="CAUSAL_LM"))
    for p in model.parameters():  # peft initialises B = 0: move it so that the adapter matters
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    head = _output_head(model)
    assert head is model.get_base_model().lm_head

    def chunked(m, b):
        out = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False, logits_to_keep=1,
                output_hidden_states=True)
        logp, ent = scored_logprobs(out.hidden_states[-1], head, b["index"], b["tokens"], temperature=TEMPERATURE,
                                    chunks=5, entropy="grad")
        return spread(logp, b["mask"]), spread(ent, b["mask"])

    batch = collate(rows(model.config.vocab_size, seed=2), pad_id=0)
    loss_f, _, lp_f, _, g_f = loss_and_grads(model, batch, full_path)
    loss_c, _, lp_c, _, g_c = loss_and_grads(model, batch, chunked)
    assert loss_c == pytest.approx(loss_f, rel=TOL) and rel(lp_c, lp_f) < TOL
    assert g_f and all("lora_" in n for n in g_f) and sorted(g_c) == sorted(g_f)
    assert max(rel(g_c[n], g_f[n]) for n in g_f) < TOL


def test_reference_log_probs_need_no_graph(tiny_model):
    model = load(tiny_model)
    batch = collate(rows(model.config.vocab_size), pad_id=0)
    with torch.no_grad():
        full, _ = full_path(model, batch)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                    logits_to_keep=1, output_hidden_states=True)
        logp, ent = scored_logprobs(out.hidden_states[-1], model.lm_head, batch["index"], batch["tokens"],
                                    temperature=TEMPERATURE, chunks=3, entropy="none")
    assert ent is None and not logp.requires_grad
    assert rel(spread(logp, batch["mask"]), full * batch["mask"]) < TOL
    with pytest.raises(ValueError, match="entropy must be"):
        scored_logprobs(out.hidden_states[-1], model.lm_head, batch["index"], batch["tokens"], temperature=1.0,
                        chunks=1, entropy="yes")


def peak_bytes(fn) -> int:
    """Peak of live CPU tensor bytes while ``fn`` runs (torch profiler's allocation events, as bench/plan_cpu.py)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def test_the_chunked_path_holds_a_few_chunks_of_logits_not_the_micro_batch(tmp_path):
    """1,024 scored tokens x a 32,768 vocabulary are 134 MB of fp32 logits; in chunks of 64 the forward and
    backward of the head and log-softmax hold, beside the head's gradient and the inputs, at most 13 bytes
    per value of one chunk (deploy/plan.py counts 12: the log-softmax kept for backward, its gradient and
    the logits' gradient), where the full path needs more than 3x the whole. Fails if a chunk's logits
    outlive it (no checkpointing) or the chunking is lost."""
    vocab, hidden, n, chunk = 32768, 64, 1024, 64
    head = torch.nn.Linear(hidden, vocab, bias=False)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(n, hidden, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    index = torch.arange(n)

    def chunked():
        logp, ent = scored_logprobs(states, head, index, targets, temperature=TEMPERATURE, chunks=n // chunk,
                                    entropy="value")
        logp.sum().backward()

    def full():
        logits = head(states).float() / TEMPERATURE
        token_logprobs(logits[None], targets[None]).sum().backward()

    fixed = (vocab * hidden + n * hidden) * 4  # the head's weight gradient and the states' gradient
    assert peak_bytes(chunked) - fixed < 13 * chunk * vocab
    assert peak_bytes(full) > 3 * n * vocab * 4  # what the planner counted before (8 t V) is of this order
