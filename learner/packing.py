"""Attention over padding-free micro-batches (``learner.packing``).

A packed micro-batch (``learner.batch.collate_packed``) is one row: its
sequences one after another, position ids restarting at 0 for each, and their
lengths. Each sequence must attend only to its own earlier tokens.

transformers 5 can mask a packed row from its position ids alone (with no
attention mask and no cache, ``masking_utils.find_packed_sequence_indices``),
but for SDPA and eager attention it does so with a dense ``N x N`` mask, and the
kernels then compute the whole ``N x N`` score matrix, cross-sequence blocks
included: attention costing the square of the micro-batch instead of the sum
of its sequences' squares (docs/performance.md, "Packed micro-batches",
gives the figures). So the learner loads the model with its own
attention implementation, :data:`ATTENTION` (registered with transformers'
``AttentionInterface``): given the sequence lengths (the ``packed_seq_lens``
keyword, which transformers passes from the model's forward down to every
attention call), it runs causal SDPA on each sequence's slice of the row: the
varlen attention of flash-attention, done as one SDPA call per run of
sequences of one length (``learner.batch.pack`` puts the longest first, so
equal lengths adjoin: a GRPO micro-batch of 128 short completions is a few
batched calls, not 128), so compute is the sum of the squared lengths and no
mask is built. Without
``packed_seq_lens`` each row is one causal sequence (right padding after it
is harmless under a causal mask; the learner never left-pads). No attention
mask function is registered for it, so transformers builds none. A layer with
a sliding window (OLMo 3) gets a banded mask per sequence longer than the
window.

:func:`packing_error` checks at start-up that the loaded model honours this
(positions restarting per sequence, the keyword reaching every attention
layer); the engine falls back to padded micro-batches when it does not.
"""

from __future__ import annotations

from itertools import groupby

import torch

ATTENTION = "tandem_packed_sdpa"
"""The ``attn_implementation`` name the learner loads a model with when packing."""


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, packed_seq_lens: tuple[int, ...] | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row (``[B, heads, N, d]`` in, ``[B, N, heads, d]`` out)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:  # none is built for this implementation; a caller's would be ignored
        raise ValueError(f"{ATTENTION} takes no attention mask; pass packed_seq_lens for a packed row")
    lens = tuple(packed_seq_lens) if packed_seq_lens is not None else (query.shape[2],)
    if sum(lens) != query.shape[2] or (len(lens) > 1 and query.shape[0] != 1):
        raise ValueError(f"packed_seq_lens {lens} do not tile a row of {query.shape[2]} tokens (batch {query.shape[0]})")
    kwargs.pop("is_causal", None)
    runs = [(n, len(list(same))) for n, same in groupby(lens)]  # the learner packs longest first: equal lengths adjoin
    outs = []
    # split, not one slice per sequence: a slice's backward writes into a zeroed copy of the whole row
    for (n, m), q, k, v in zip(runs, *(x.split([n * m for n, m in runs], dim=2) for x in (query, key, value)),
                               strict=True):
        mask = None
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=query.device)
            mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window))[None, None]
        if m > 1:  # m sequences of n tokens: one batched call, [1, heads, m * n, d] as [m, heads, n, d]
            q, k, v = (x.unflatten(2, (m, n)).squeeze(0).transpose(0, 1) for x in (q, k, v))
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                        is_causal=True, **kwargs)
        outs.append(out.reshape(1, m * n, *out.shape[2:]) if m > 1 else out)  # [m, n, heads, d] back to one row
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def register() -> str:
    """Make :data:`ATTENTION` loadable by name (``from_pretrained(attn_implementation=...)``); idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    return ATTENTION


PROBE_LENS = (5, 3, 4)
"""Sequence lengths of the start-up check (token ids derived from the vocabulary size)."""


@torch.no_grad()
def packing_error(model: torch.nn.Module, vocab_size: int, device: torch.device) -> str | None:
    """Why ``model`` (in eval mode) computes a packed row differently from its sequences apart, or None.

    Runs :data:`PROBE_LENS` sequences packed and one by one and compares the
    final hidden states: attention across sequences changes them by a large
    fraction of their size, float rounding (bf16 included) by far less.
    A collective under ZeRO-3: every rank runs it.
    """
    seqs = [torch.arange(n, device=device) * 7 % max(vocab_size - 3, 1) + 3 + i for i, n in enumerate(PROBE_LENS)]
    apart = [_hidden(model, s[None], torch.arange(len(s), device=device)[None], None) for s in seqs]
    packed = _hidden(model, torch.cat(seqs)[None], torch.cat([torch.arange(n, device=device) for n in PROBE_LENS])[None],
                     PROBE_LENS)
    expected = torch.cat(apart, dim=1).float()
    rel = float((packed.float() - expected).norm() / expected.norm().clamp(min=1e-12))
    if rel > 0.05:
        return (f"packed sequences' hidden states differ from the sequences run apart by {rel:.2f} of their norm "
                "(the model's attention does not keep packed sequences apart)")
    return None


def _hidden(model, ids, positions, lens):
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1, output_hidden_states=True,
                **({"packed_seq_lens": lens} if lens else {}))
    return out.hidden_states[-1]
