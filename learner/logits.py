r"""Log-probabilities and entropy of the completion tokens, a chunk of tokens at a time.

The learner needs, for each completion token, \log\pi_\theta(o_t) and the
entropy H_t of the token distribution (``learner.loss``). Computing them from
the model's logits over a whole micro-batch holds ``t x V`` fp32 values (t
tokens, V the vocabulary: 8,192 x 151,936 x 4 bytes = 5 GB for Qwen3, twice
over with the log-softmax kept for backward). Here the model runs without its
output head; its final hidden states are taken at the positions that predict a
completion token only (prompt positions are never scored), and the head,
the temperature and the log-softmax are applied ``learner.logit_chunk_tokens``
rows at a time. Each chunk is checkpointed (``torch.utils.checkpoint``): its
logits are freed after the forward pass and recomputed, one chunk at a time,
in the backward pass. The learner's peak therefore holds one chunk's logits
and their gradient (``deploy/plan.py`` counts them), at the cost of running
the head twice. The values are those of ``learner.loss.token_logprobs`` and
``token_entropy`` over the full logits, up to float rounding
(tests/integration/learner/test_logits.py).

**Held-back end tokens** (``sampling.min_tokens``). vLLM's sampler masks the end-of-sequence
tokens (:func:`stop_token_ids`) before a completion's ``min_tokens``-th token, and its processed
log-probs are taken after that mask: the behaviour distribution there is ``softmax(logits / T)``
renormalised over the other tokens. The learner applies the same mask at the same positions
(``held``: ``learner.batch.collate``), so that the importance ratio compares one distribution with
itself (without it the ratio of a fresh sample would be ``1 - P(EOS)`` there, not 1) and the policy
trained is the one that samples: no gradient reaches an end token where it cannot be drawn.

The head is called as a module once per chunk, so under ZeRO-3 each call
gathers its weight: every rank must make the same number of calls, and
:func:`chunk_count` is agreed across ranks by the engine (an empty chunk still
calls the head and joins the loss's graph). The same holds for the head's
gradient hooks in the backward pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint


def chunk_count(tokens: int, chunk_tokens: int) -> int:
    """Chunks for ``tokens`` scored tokens, at least one (an empty micro-batch still calls the head)."""
    return max(1, math.ceil(tokens / chunk_tokens))


def stop_token_ids(model_dir: str | Path) -> list[int]:
    """The tokens vLLM's ``min_tokens`` holds back in a completion's first tokens: the tokenizer's EOS
    and the generation config's ``eos_token_id`` (an id or a list; from ``config.json`` when there is no
    ``generation_config.json``), as ``SamplingParams.update_from_generation_config`` gathers them. The
    run's requests carry no ``stop_token_ids`` of their own (stop strings are not masked)."""
    from transformers import AutoTokenizer, GenerationConfig

    ids = set()
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    if eos is not None:
        ids.add(int(eos))
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: vLLM derives it from config.json
        from transformers import AutoConfig

        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    eos = generation.eos_token_id
    ids.update(int(i) for i in ([] if eos is None else eos if isinstance(eos, list) else [eos]))
    return sorted(ids)


def _chunk(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float,
           entropy: str, held: torch.Tensor | None = None,
           stops: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and the entropy for ``hidden`` ``[n, H]`` rows: the head, the sampling
    temperature (the behaviour log-probs describe softmax(logits / T)), the ``stops`` tokens masked
    on the ``held`` rows, and a float32 log-softmax."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    masked = held is not None and stops is not None and stops.numel() > 0
    if masked:
        is_stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        is_stop[stops] = True
        # a held row whose own token is an end token was not sampled under the mask: leave it whole
        rows = held & ~is_stop[targets]
        logits = logits.masked_fill(rows[:, None] & is_stop[None, :], float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    del logits
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            # p log p is 0 where p = 0 (a masked token), not 0 x -inf
            ent = -(logp.exp() * (logp.masked_fill(logp.isneginf(), 0.0) if masked else logp)).sum(dim=-1)
    return chosen, ent


def scored_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    index: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunks: int,
    entropy: str = "value",
    held: torch.Tensor | None = None,
    stops: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropies ``[n]`` of the ``n`` scored tokens, in ``chunks`` pieces.

    ``hidden`` is the model's final hidden states (any leading shape, ``H`` last);
    ``index`` ``[n]`` the flat positions in it whose next-token distribution
    scores ``targets`` ``[n]``. ``entropy``: ``"grad"`` (an entropy bonus in
    the loss: differentiable), ``"value"`` (a statistic, no gradient) or
    ``"none"`` (not computed; None). Under ``torch.no_grad`` (the reference
    model) nothing is checkpointed. ``held`` ``[n]`` (bool): the tokens sampled with the ``stops``
    token ids masked (before ``sampling.min_tokens``; module docstring).
    """
    if entropy not in ("grad", "value", "none"):
        raise ValueError(f"entropy must be 'grad', 'value' or 'none', not {entropy!r}")
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    helds = torch.tensor_split(held, chunks) if held is not None else [None] * chunks
    logps, entropies = [], []
    for h, t, k in zip(torch.tensor_split(rows, chunks), torch.tensor_split(targets, chunks), helds, strict=True):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk, h, t, head, temperature, entropy, k, stops, use_reentrant=False)
        else:
            lp, ent = _chunk(h, t, head, temperature, entropy, k, stops)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), None if entropy == "none" else torch.cat(entropies)


def spread(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` ``[n]`` laid out as ``mask`` ``[B, T]`` (row-major over its ones), zeros elsewhere."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask.bool(), values)
