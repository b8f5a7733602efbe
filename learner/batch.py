"""From accepted trajectory groups to micro-batches.

The learner's rank 0 turns the groups of one optimizer step into
:class:`TrainSeq` rows (advantages and aggregation weights computed over the
*whole* batch, see ``learner.loss``), splits them across data-parallel ranks
balanced by tokens, and each rank groups its share into micro-batches of at
most ``learner.micro_batch_tokens`` tokens. Every rank runs the same number of
micro-batches (short ranks add empty ones) because ZeRO-3 gathers parameters
collectively in every forward pass.

Two layouts (``learner.packing``): :func:`pack` + :func:`collate` with
``packed=True`` concatenate a micro-batch's sequences into one row with
per-sequence position ids (``learner.packing`` keeps their attention apart),
so the budget counts real tokens and no compute goes to padding;
:func:`bucket` + ``packed=False`` give one right-padded row per sequence,
micro-batches of similar lengths whose *padded* size fits the budget. Either
way the loss sees the same ``[B, T]`` tensors, one row per completion.

Inputs from the stream are validated here (:func:`check_group`) before any
tensor is built: a bad group is dead-lettered by the caller with the reason
returned, and the learner keeps running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from learner.advantages import group_advantages, has_signal
from learner.loss import aggregation_coefs
from services.config import LossConfig
from services.wire import TrajectoryGroup


@dataclass(frozen=True)
class TrainSeq:
    """One completion to train on: prompt and completion ids, behaviour log-probs, A_i and c_i.

    ``trained``: for an episode (``services.wire.ScoredSample.mask``), 1 on the completion tokens the model
    generated and 0 on tool observations, which are read (the model attends to them) but never scored:
    no gradient, no KL or entropy, no count in the aggregation. None: every completion token is trained."""

    group_id: str
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    behav: tuple[float, ...]
    advantage: float
    coef: float
    trained: tuple[int, ...] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)

    @property
    def scored(self) -> int:
        """Completion tokens the loss scores (the model's own)."""
        return len(self.completion) if self.trained is None else sum(self.trained)


def check_group(group: TrajectoryGroup, vocab_size: int, max_len: int) -> str | None:
    """Why ``group`` cannot be trained on by a model of ``vocab_size`` and ``max_len``, or None.

    (Logprob/token length mismatches are already refused by the wire type's
    validator when the payload is decoded.)
    """
    bad = [t for t in group.prompt_token_ids if t >= vocab_size]
    if bad:
        return f"prompt token id {bad[0]} >= vocab size {vocab_size}"
    for i, s in enumerate(group.samples):
        bad = [t for t in s.token_ids if t >= vocab_size]
        if bad:
            return f"sample {i}: token id {bad[0]} >= vocab size {vocab_size}"
        if len(s.logprobs) != len(s.token_ids):
            return f"sample {i}: {len(s.logprobs)} logprobs for {len(s.token_ids)} tokens"
        total = len(group.prompt_token_ids) + len(s.token_ids)
        if total > max_len:
            return f"sample {i}: prompt + completion is {total} tokens, over the model's {max_len}"
    return None


def group_has_signal(group: TrajectoryGroup) -> bool:
    return has_signal([s.reward for s in group.samples])


def build_batch(groups: Sequence[TrajectoryGroup], cfg: LossConfig, max_tokens: int) -> list[TrainSeq]:
    """The rows of one optimizer step, in group order.

    Advantages use every sample of a group (the group is the baseline);
    overlong-filtered and empty completions are then left out, and the
    aggregation weights are computed over the rows that remain.
    """
    rows: list[TrainSeq] = []
    for g in groups:
        advs = group_advantages([s.reward for s in g.samples], cfg.advantage)
        for s, a in zip(g.samples, advs, strict=True):
            if not s.token_ids or (s.mask and not any(s.mask)):
                continue  # nothing to learn from an empty completion (or one of observations only)
            if cfg.drop_overlong and s.finish_reason == "length":
                continue
            rows.append(TrainSeq(g.group_id, tuple(g.prompt_token_ids), tuple(s.token_ids), tuple(s.logprobs), a, 0.0,
                                 tuple(s.mask) if s.mask and not all(s.mask) else None))
    if not rows:
        return []
    norm = cfg.norm_tokens or max_tokens * len(rows)
    coefs = aggregation_coefs(cfg.aggregation, [r.scored for r in rows], norm)
    return [dataclasses.replace(r, coef=k) for r, k in zip(rows, coefs, strict=True)]


def split_ranks(seqs: Sequence[TrainSeq], world: int) -> list[list[TrainSeq]]:
    """Deal rows to ``world`` ranks, longest first to the rank with fewest tokens (deterministic)."""
    shares: list[list[TrainSeq]] = [[] for _ in range(world)]
    load = [0] * world
    for s in sorted(seqs, key=lambda s: (-s.length, s.group_id, s.completion)):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(s)
        load[r] += s.length
    return shares


def bucket(seqs: Sequence[TrainSeq], budget_tokens: int) -> list[list[TrainSeq]]:
    """Padded micro-batches: rows whose padded size (rows x longest) is within ``budget_tokens``.

    Rows are sorted by length so padding stays small (bucketing by length); a
    row longer than the budget gets a micro-batch of its own.
    """
    out: list[list[TrainSeq]] = []
    cur: list[TrainSeq] = []
    for s in sorted(seqs, key=_longest_first):
        longest = max([s.length] + [x.length for x in cur])
        if cur and (len(cur) + 1) * longest > budget_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def pack(seqs: Sequence[TrainSeq], budget_tokens: int) -> list[list[TrainSeq]]:
    """Padding-free micro-batches: rows whose total length is within ``budget_tokens``.

    First-fit decreasing (longest row first, into the first micro-batch with
    room), which keeps the count of micro-batches near the fewest possible; a
    row longer than the budget gets a micro-batch of its own. Deterministic.
    """
    out: list[list[TrainSeq]] = []
    room: list[int] = []
    for s in sorted(seqs, key=_longest_first):
        i = next((i for i, r in enumerate(room) if s.length <= r), None)
        if i is None:
            out.append([])
            room.append(budget_tokens)
            i = len(out) - 1
        out[i].append(s)
        room[i] -= s.length
    return out


def _longest_first(s: TrainSeq) -> tuple:
    return -s.length, s.group_id, s.completion


def collate(mb: Sequence[TrainSeq], pad_id: int, *, packed: bool = False, min_tokens: int = 0) -> dict:
    """The tensors of a micro-batch; an empty ``mb`` gives one all-masked dummy row.

    For the loss, one row per completion, right-padded to the longest less one
    (``T``) and aligned with the position that predicts each next token:
    ``targets``, ``mask`` (1 on completion tokens, but an episode's observation tokens), ``behav``, ``coef``
    ``[B, T]`` and ``advantages`` ``[B]``.

    For the model: padded, ``input_ids`` and ``attention_mask`` ``[B, L]``;
    ``packed``, ``input_ids`` and ``position_ids`` ``[1, N]`` (N the sum of the
    lengths, positions restarting at 0 for each sequence) and ``seq_lens`` (a
    tuple of ints). ``index`` ``[n]`` holds, for each completion token in the
    row-major order of ``mask``'s ones, the flat position of the model's output
    that predicts it, and ``tokens`` ``[n]`` the token (``learner.logits``). With ``min_tokens``
    (``sampling.min_tokens``), ``held`` ``[n]`` marks the tokens the sampler drew with the end tokens
    held back: each completion's first ``min_tokens`` tokens of the model's own (an episode counts
    over its turns; ``rollout_server.episodes``).
    """
    import torch

    rows = list(mb) or [TrainSeq("", (pad_id,), (pad_id,), (0.0,), 0.0, 0.0)]
    dummy = not mb
    b, length = len(rows), max(s.length for s in rows)
    targets = torch.full((b, length - 1), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length - 1))
    behav = torch.zeros((b, length - 1))
    coef = torch.zeros((b, length - 1))
    adv = torch.zeros(b)
    index: list[int] = []
    tokens: list[int] = []
    held: list[bool] = []
    start = 0  # where each row's first token sits in the model's flattened input
    for i, s in enumerate(rows):
        ids = s.prompt + s.completion
        targets[i, : len(ids) - 1] = torch.tensor(ids[1:], dtype=torch.long)
        p, c = len(s.prompt), len(s.completion)
        # completion token j sits at position p + j and is predicted by the output at p + j - 1
        if not dummy and s.trained is None:
            mask[i, p - 1 : p - 1 + c] = 1.0
            index.extend(range(start + p - 1, start + p - 1 + c))
            tokens.extend(s.completion)
        elif not dummy:  # an episode: its observation tokens are context, never scored
            mask[i, p - 1 : p - 1 + c] = torch.tensor(s.trained, dtype=torch.float32)
            index.extend(start + p - 1 + j for j, t in enumerate(s.trained) if t)
            tokens.extend(tok for tok, t in zip(s.completion, s.trained, strict=True) if t)
        if not dummy:  # the k-th of the model's own tokens was drawn with the end tokens held back if k < min_tokens
            held.extend(k < min_tokens for k in range(s.scored))
        behav[i, p - 1 : p - 1 + c] = torch.tensor(s.behav, dtype=torch.float32)
        coef[i, p - 1 : p - 1 + c] = s.coef
        adv[i] = s.advantage
        start += len(ids) if packed else length
    out = {"targets": targets, "mask": mask, "behav": behav, "coef": coef, "advantages": adv,
           "index": torch.tensor(index, dtype=torch.long), "tokens": torch.tensor(tokens, dtype=torch.long)}
    if min_tokens:
        out["held"] = torch.tensor(held, dtype=torch.bool)
    if packed:
        out["input_ids"] = torch.tensor([[t for s in rows for t in s.prompt + s.completion]], dtype=torch.long)
        out["position_ids"] = torch.cat([torch.arange(s.length) for s in rows])[None]
        out["seq_lens"] = tuple(s.length for s in rows)
    else:
        input_ids = torch.full((b, length), pad_id, dtype=torch.long)
        attn = torch.zeros((b, length), dtype=torch.long)
        for i, s in enumerate(rows):
            input_ids[i, : s.length] = torch.tensor(s.prompt + s.completion, dtype=torch.long)
            attn[i, : s.length] = 1
        out["input_ids"], out["attention_mask"] = input_ids, attn
    return out
