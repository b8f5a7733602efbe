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

The head is called as a module once per chunk, so under ZeRO-3 each call
gathers its weight: every rank must make the same number of calls, and
:func:`chunk_count` is agreed across ranks by the engine (an empty chunk still
calls the head and joins the loss's graph). The same holds for the head's
gradient hooks in the backward pass.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint


def chunk_count(tokens: int, chunk_tokens: int) -> int:
    """Chunks for ``tokens`` scored tokens, at least one (an empty micro-batch still calls the head)."""
    return max(1, math.ceil(tokens / chunk_tokens))


def _chunk(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float,
           entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and the entropy for ``hidden`` ``[n, H]`` rows: the head, the sampling
    temperature (the behaviour log-probs describe softmax(logits / T)) and a float32 log-softmax."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    del logits
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            ent = -(logp.exp() * logp).sum(dim=-1)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropies ``[n]`` of the ``n`` scored tokens, in ``chunks`` pieces.

    ``hidden`` is the model's final hidden states (any leading shape, ``H`` last);
    ``index`` ``[n]`` the flat positions in it whose next-token distribution
    scores ``targets`` ``[n]``. ``entropy``: ``"grad"`` (an entropy bonus in
    the loss: differentiable), ``"value"`` (a statistic, no gradient) or
    ``"none"`` (not computed; None). Under ``torch.no_grad`` (the reference
    model) nothing is checkpointed.
    """
    if entropy not in ("grad", "value", "none"):
        raise ValueError(f"entropy must be 'grad', 'value' or 'none', not {entropy!r}")
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    logps, entropies = [], []
    for h, t in zip(torch.tensor_split(rows, chunks), torch.tensor_split(targets, chunks), strict=True):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk, h, t, head, temperature, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(h, t, head, temperature, entropy)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), None if entropy == "none" else torch.cat(entropies)


def spread(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` ``[n]`` laid out as ``mask`` ``[B, T]`` (row-major over its ones), zeros elsewhere."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask.bool(), values)
