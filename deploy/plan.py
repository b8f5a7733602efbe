"""A memory planner: does a GRPO run of this model fit on these GPUs?

Pure arithmetic over ``deploy/presets.py``; no torch. ``tandem plan`` prints
it. Figures are per GPU, in GB (1e9 bytes), against the nominal memory Modal
quotes for the GPU type; a plan fits when its total is at most
``HEADROOM`` (0.9) of that, the rest left to fragmentation and allocator
slack.

The layout it plans is the one tandem runs (``deploy/layout.py``; ``plan_args``
there turns a deployment's layout into this module's arguments). On Modal the
learner and the rollout servers are separate containers on separate GPUs: the
learner's N GPUs hold the learner alone (plus the runtime), and each rollout
server's vLLM engine is tensor-parallel over its own R GPUs (``rollout_gpus``,
default one GPU of the learner's type), each holding 1/R of the weights and of
the KV cache, against vLLM's own budget: ``gpu_memory_utilization`` (0.85,
``rollout_server.settings``) of the GPU, which the engine takes whole. A
colocated plan (``colocated=True``: one machine running both on the same GPUs)
is the other layout: the learner and the rollout engine share the N GPUs and
vLLM is tensor-parallel over all of them (R = N). The learner is one DeepSpeed job with one rank per GPU, each
rank taking micro-batches of at most ``micro_batch_tokens`` tokens (the
learner's ``learner.micro_batch_tokens``, default 8192; a sequence longer
than that is a micro-batch of its own, so ``t = max(micro_batch_tokens, L)``).
Packed or padded (``learner.packing``), a micro-batch's tokens are within
that budget. Per GPU, with P the model's parameters, T the
trainable ones (P for ``full``; the LoRA adapter otherwise), N GPUs and
ZeRO stage z:

- learner weights: bf16, 2 bytes/param (``qlora``: NF4 base, 0.5 bytes plus
  0.016 for the double-quantized block constants, embeddings and head kept
  in bf16), plus the bf16 adapter; divided by N at z = 3. With offload at
  z = 3 the parameters live in CPU memory and the GPU holds two gathered
  layers (the one running and the one prefetched).
- gradients: bf16, 2 bytes x T; divided by N at z >= 2.
- optimizer: Adam fp32 master weights + m + v, 12 bytes x T (ZeRO's K = 12,
  Rajbhandari et al. 2020); divided by N at z >= 1; 0 with offload (CPU).
- activations, for t micro-batch tokens of sequence length s = L, a layers, h
  hidden, n_h heads, V vocabulary. One layer's working set, from
  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", eq. 1, 16-bit, no sequence parallelism), is
  ``(34 h + 5 n_h s)`` bytes/token (the ``5 n_h s`` term is the attention
  scores, an upper bound where a fused kernel does not materialize them).
  Without checkpointing every layer keeps it: ``t a (34 h + 5 n_h s)``.
  With checkpointing each layer keeps only its bf16 input, and one layer is
  recomputed at a time: ``t (2 h a + 34 h + 5 n_h s)``. Both add the logits
  of one chunk, ``12 c V`` with c = min(``logit_chunk_tokens``, t): the
  learner never builds the micro-batch's logits (``learner/logits.py``); it
  applies the head and the fp32 log-softmax to c tokens at a time and
  recomputes each chunk in the backward pass, where the fp32 log-softmax
  kept for it, its gradient and the gradient of the logits live together
  (12 bytes per value for a chunk measured alone on CPU; ``bench/plan_cpu.py``'s
  wide model checks the figure inside the learner's step; an entropy
  bonus, ``loss.entropy_coef > 0``, adds 8 more, not counted here).
- reference model: only when ``loss.beta > 0`` (the default is 0, so none).
  For ``full`` a frozen bf16 copy, divided by N at z = 3; LoRA takes the
  reference from the adapter-disabled base, so it costs nothing.
- rollout weights: the base in bf16 (NF4 for ``qlora``; vLLM serves
  bitsandbytes checkpoints) / R (on the rollout GPUs; / N on shared ones).
- KV cache: ``2 a n_kv d 2`` bytes per token (K and V, bf16), for
  ``groups_in_flight x G x L`` tokens, / N. The default, 2 groups, is one
  group decoding and the next admitted; vLLM queues (or preempts) the rest
  of a step's groups rather than needing their cache at once. Every layer is
  counted at full length, an upper bound for OLMo 3's sliding-window layers
  past 4096 tokens. / R, as the weights.
- runtime: 2 GB on each GPU (a CUDA context, NCCL buffers; vLLM's graphs and
  profiling activations on a rollout GPU), counted once on shared GPUs.

``dtype_bytes`` (default 2) is the learner's precision: 2 for bf16 (every
GPU figure above), 4 for fp32 (``learner.precision = "fp32"``, the default
on CPU, where ``bench/plan_cpu.py`` measures the planner). It scales the
learner's weights, gradients, activations and reference copy (activations:
the 16-bit figures above times ``dtype_bytes / 2``; the fp32 logits term is
already fp32); the rollout engine stays bf16. An fp32 learner at z = 0 has
no master copy (DeepSpeed hands the torch AdamW the fp32 weights
themselves), so its optimizer is m + v, 8 bytes x T; at z >= 1 ZeRO clones
the fp32 partition all the same, so K stays 12.

The optimizer step's transients: at z >= 1 (no offload) an fp32 copy of
the gradient partition and Adam's ``sqrt(v) + eps``, 8 bytes x T / N, live
after the activations are freed; the learner's peak takes the larger of the
two (``bench/plan_cpu.py`` measured the peak inside the step wherever
checkpointed activations were the smaller).

Not counted: DeepSpeed's gradient reduce bucket. At z >= 1 its ZeRO
optimizer allocates one bucket of ``reduce_bucket_size`` (5e8 by default)
elements in the gradients' dtype (1 GB in bf16) per GPU, whatever the
model's size; it comes out of the runtime allowance and the headroom
(``bench/plan_cpu.py`` measures it and sets it apart).

What ``tandem plan`` answers (``search``): on the GPUs it is given, the
first configuration that fits, varying what the user left open: the
rollout's tensor-parallel size (separate rollout GPUs only), offload, the
ZeRO stage (``candidates`` gives the order). Only when none fits does it
look further, and then at more GPUs only (``smallest_fit``), so it never
answers "does not fit" on the GPUs it names as the fit.
"""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from deploy.presets import ModelPreset
from rollout_server.settings import RolloutSettings
from services.config import LearnerConfig

GB = 1e9
HEADROOM = 0.9
"""Fraction of a learner GPU's memory a plan may fill."""
ROLLOUT_FRACTION = RolloutSettings.model_fields["gpu_memory_utilization"].default
"""Fraction of a rollout GPU's memory vLLM takes (``gpu_memory_utilization``): the rollout budget."""
ROLLOUT_GPU_COUNTS = (1, 2, 4, 8)
"""Tensor-parallel sizes ``candidates`` tries for a separate rollout replica (a container has at most 8 GPUs)."""
GPU_MEMORY_GB: dict[str, float] = {
    "H100": 80, "H200": 141, "A100-80GB": 80, "A100-40GB": 40, "L40S": 48, "A10": 24, "L4": 24, "B200": 180,
}
"""GPU types as Modal spells them, with their memory."""
GPU_COUNTS = (1, 2, 4, 8, 16)
"""The GPU counts ``smallest_fit`` tries."""
RUNTIME_GB = 2.0
QLORA_BYTES = 0.5 + 0.016
LOGIT_BYTES = 12
"""Bytes per logit value of the one chunk the learner holds (fp32 log-softmax, its gradient, the logits' gradient)."""
MICRO_BATCH_TOKENS = LearnerConfig.model_fields["micro_batch_tokens"].default
LOGIT_CHUNK_TOKENS = LearnerConfig.model_fields["logit_chunk_tokens"].default


class Mode(StrEnum):
    lora = "lora"
    qlora = "qlora"
    full = "full"


def parse_gpus(spec: str) -> tuple[str, int]:
    """``"8xH100"``, ``"H100:8"`` or ``"H100"`` -> ``("H100", 8)``; type names are case-insensitive."""
    m = re.fullmatch(r"(?:(\d+)\s*[xX]\s*)?([A-Za-z0-9-]+?)(?::(\d+))?", spec.strip())
    if not m or (m.group(1) and m.group(3)):
        raise ValueError(f"cannot read GPUs {spec!r}; write them as 8xH100 or H100:8")
    names = {k.lower(): k for k in GPU_MEMORY_GB}
    kind = names.get(m.group(2).lower())
    if kind is None:
        raise ValueError(f"unknown GPU type {m.group(2)!r}; valid: {', '.join(GPU_MEMORY_GB)}")
    count = int(m.group(1) or m.group(3) or 1)
    if count < 1:
        raise ValueError(f"GPU count must be at least 1 in {spec!r}")
    return kind, count


class Plan(BaseModel):
    """Memory per GPU, in GB, of one configuration. ``total`` counts the
    activations with or without checkpointing as ``checkpointing`` says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    mode: Mode
    gpu: str
    gpus: int
    gpu_memory: float
    zero_stage: int
    offload: bool
    checkpointing: bool
    group_size: int
    max_tokens: int
    micro_batch_tokens: int
    logit_chunk_tokens: int
    groups_in_flight: int
    beta: float
    colocated: bool
    rollout_gpu: str
    rollout_gpus: int
    """GPUs one rollout model replica is tensor-parallel over (``gpus`` when colocated)."""
    rollout_gpu_memory: float
    weights: float
    gradients: float
    optimizer: float
    activations_checkpointed: float
    activations_full: float
    optimizer_step: float
    reference: float
    rollout_weights: float
    kv_cache: float
    runtime: float

    @property
    def activations(self) -> float:
        return self.activations_checkpointed if self.checkpointing else self.activations_full

    @property
    def learner(self) -> float:
        """The learner's peak: its state plus the larger of the activations and the optimizer step's
        transients (the step runs after the activations are freed)."""
        return (self.weights + self.gradients + self.optimizer + max(self.activations, self.optimizer_step)
                + self.reference)

    @property
    def rollout(self) -> float:
        """What the rollout engine holds per GPU: its weights, the KV cache and the runtime."""
        return self.rollout_weights + self.kv_cache + self.runtime

    @property
    def total(self) -> float:
        """Per learner GPU (shared with the rollout engine when colocated)."""
        if self.colocated:
            return self.learner + self.rollout_weights + self.kv_cache + self.runtime
        return self.learner + self.runtime

    @property
    def budget(self) -> float:
        return HEADROOM * self.gpu_memory

    @property
    def rollout_budget(self) -> float:
        """vLLM's share of a rollout GPU (the learner's budget when colocated)."""
        return self.budget if self.colocated else ROLLOUT_FRACTION * self.rollout_gpu_memory

    @property
    def rollout_fits(self) -> bool:
        return self.total <= self.budget if self.colocated else self.rollout <= self.rollout_budget

    @property
    def fits(self) -> bool:
        return self.total <= self.budget and self.rollout_fits

    @property
    def learner_label(self) -> str:
        off = ", offload" if self.offload else ""
        return f"{self.gpus}x{self.gpu}, ZeRO-{self.zero_stage}{off}"

    @property
    def choice(self) -> str:
        """The settings ``tandem plan`` searches, as it reports them: ZeRO stage, offload, vLLM's
        tensor-parallel size."""
        off = "offload" if self.offload else "no offload"
        return f"ZeRO-{self.zero_stage}, {off}, vLLM tensor-parallel over {self.rollout_gpus}"

    @property
    def label(self) -> str:
        where = "colocated" if self.colocated else f"rollout {self.rollout_gpus}x{self.rollout_gpu} per server"
        return f"{self.learner_label}; {where}"


def lora_params(p: ModelPreset, rank: int = 8) -> float:
    """Adapter parameters for rank ``rank`` on q/k/v/o (the learner's default targets)."""
    q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
    per_layer = (p.hidden + q) + 2 * (p.hidden + kv) + (q + p.hidden)
    return p.layers * rank * per_layer


def base_bytes(p: ModelPreset, mode: Mode) -> float:
    """The frozen (or, for ``full``, trained) base model's weights in bytes."""
    if mode is Mode.qlora:
        return (p.params - p.embedding_params) * QLORA_BYTES + p.embedding_params * 2
    return p.params * 2


def default_zero_stage(mode: Mode, gpus: int) -> int:
    """3 for ``full``; 0 on one GPU and 2 on more for LoRA."""
    if mode is Mode.full:
        return 3
    return 0 if gpus == 1 else 2


def plan(
    p: ModelPreset,
    mode: Mode | str,
    gpus: str,
    *,
    group_size: int = 8,
    max_tokens: int = 1024,
    zero_stage: int | None = None,
    offload: bool = False,
    checkpointing: bool = True,
    beta: float = 0.0,
    groups_in_flight: int = 2,
    lora_rank: int = 8,
    dtype_bytes: int = 2,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    logit_chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    rollout_gpus: str | None = None,
    colocated: bool = False,
) -> Plan:
    """Per-GPU memory of a GRPO run (formulas in the module docstring); ``dtype_bytes`` is the
    learner's precision, 2 (bf16) or 4 (fp32); ``micro_batch_tokens`` and ``logit_chunk_tokens``
    the learner's settings of those names. ``gpus`` are the learner's; ``rollout_gpus`` those of
    one rollout model replica (default one of the learner's type), separate unless ``colocated``
    (then the rollout engine shares ``gpus`` and ``rollout_gpus`` must be unset)."""
    if mode not in set(Mode):
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(Mode)}")
    mode = Mode(mode)
    kind, n = parse_gpus(gpus)
    if colocated and rollout_gpus is not None:
        raise ValueError("a colocated plan serves on the learner's GPUs; rollout_gpus is for a separate fleet")
    rollout_kind, r = (kind, n) if colocated else parse_gpus(rollout_gpus or f"1x{kind}")
    if r not in ROLLOUT_GPU_COUNTS and not colocated:
        raise ValueError(f"a rollout server has 1, 2, 4 or 8 GPUs, not {r}")
    z = default_zero_stage(mode, n) if zero_stage is None else zero_stage
    if z not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {z}")
    if offload and z == 0:
        raise ValueError("offload needs ZeRO stage 1 or more (the optimizer state is what moves to CPU)")
    if min(group_size, max_tokens, groups_in_flight, micro_batch_tokens, logit_chunk_tokens) < 1:
        raise ValueError("group_size, max_tokens, groups_in_flight, micro_batch_tokens and logit_chunk_tokens "
                         "must be positive")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16) or 4 (fp32), not {dtype_bytes}")
    widen = dtype_bytes / 2  # the learner's tensors against the bf16 figures

    trainable = p.params if mode is Mode.full else lora_params(p, lora_rank)
    base = base_bytes(p, mode)
    # QLoRA's base is NF4 with bf16 embeddings whatever the adapter's precision
    learner_base, emb_bytes = (base, 2) if mode is Mode.qlora else (base * widen, dtype_bytes)
    if z == 3 and offload:
        per_layer = (learner_base - p.embedding_params * emb_bytes) / p.layers
        weights = 2 * per_layer
    else:
        weights = learner_base / n if z == 3 else learner_base
    if mode is not Mode.full:
        weights += dtype_bytes * trainable
    gradients = dtype_bytes * trainable / (n if z >= 2 else 1)
    adam = 8 if dtype_bytes == 4 and z == 0 else 12  # no master copy of weights already fp32
    optimizer = 0.0 if offload else adam * trainable / (n if z >= 1 else 1)
    step = 0.0 if offload or z == 0 else 8 * trainable / n

    t, s, h, a = max(micro_batch_tokens, max_tokens), max_tokens, p.hidden, p.layers
    layer = (34 * h + 5 * p.heads * s) * widen
    logits = LOGIT_BYTES * min(logit_chunk_tokens, t) * p.vocab
    act_full = t * a * layer + logits
    act_ckpt = t * (dtype_bytes * h * a + layer) + logits

    reference = 0.0
    if beta > 0 and mode is Mode.full:
        reference = learner_base / n if z == 3 else learner_base

    kv_per_token = 2 * a * p.kv_heads * p.head_dim * 2
    kv = kv_per_token * groups_in_flight * group_size * max_tokens / r

    return Plan(
        model=p.short_name, mode=mode, gpu=kind, gpus=n, gpu_memory=GPU_MEMORY_GB[kind], zero_stage=z,
        offload=offload, checkpointing=checkpointing, group_size=group_size, max_tokens=max_tokens,
        micro_batch_tokens=micro_batch_tokens, logit_chunk_tokens=logit_chunk_tokens,
        groups_in_flight=groups_in_flight, beta=beta, colocated=colocated, rollout_gpu=rollout_kind,
        rollout_gpus=r, rollout_gpu_memory=GPU_MEMORY_GB[rollout_kind],
        weights=weights / GB, gradients=gradients / GB, optimizer=optimizer / GB,
        activations_checkpointed=act_ckpt / GB, activations_full=act_full / GB, optimizer_step=step / GB,
        reference=reference / GB,
        rollout_weights=base / r / GB, kv_cache=kv / GB, runtime=RUNTIME_GB,
    )


def candidates(
    p: ModelPreset,
    mode: Mode | str,
    gpus: str,
    *,
    zero_stage: int | None = None,
    offload: bool | None = None,
    rollout_gpus: str | None = None,
    colocated: bool = False,
    **kwargs,
) -> list[Plan]:
    """Every configuration on exactly ``gpus`` with what the caller left open (None) varied, in the order
    tandem prefers them: the fewest rollout GPUs (separate layout; 1, 2, 4 or 8 of the learner's type,
    tensor-parallel; colocated, vLLM is tensor-parallel over all of ``gpus``), then no offload before offload
    (offload trades step time for memory), then ZeRO stages from low (less communication) to high.
    ``kwargs`` go to ``plan``."""
    kind, _ = parse_gpus(gpus)
    if colocated or rollout_gpus is not None:
        rollouts: list[str | None] = [rollout_gpus]
    else:
        rollouts = [f"{r}x{kind}" for r in ROLLOUT_GPU_COUNTS]
    offloads = [False, True] if offload is None else [offload]
    found = []
    for r in rollouts:
        for off in offloads:
            stages = [zero_stage] if zero_stage is not None else [1, 2, 3] if off else [0, 1, 2, 3]
            found += [plan(p, mode, gpus, zero_stage=z, offload=off, rollout_gpus=r, colocated=colocated, **kwargs)
                      for z in stages]
    return found


def search(p: ModelPreset, mode: Mode | str, gpus: str, **kwargs) -> Plan:
    """``tandem plan``'s answer on exactly ``gpus``: the first of ``candidates`` that fits, else the nearest
    miss (the least overshoot of the learner's or vLLM's budget, whichever is worse). ``kwargs`` go to
    ``candidates``."""
    found = candidates(p, mode, gpus, **kwargs)
    return next((c for c in found if c.fits), None) or min(found, key=overshoot)


def overshoot(c: Plan) -> float:
    """How far ``c`` is over its budgets, as the larger ratio of need to budget (at most 1 when it fits)."""
    return max(c.total / c.budget, c.rollout / c.rollout_budget)


def smallest_fit(
    p: ModelPreset, mode: Mode | str, gpu: str, *, offload: bool | None = False, more_than: int = 0, **kwargs
) -> Plan | None:
    """The first plan that fits, trying 1, 2, 4, 8 and 16 GPUs of ``gpu``'s
    type (its count is ignored), those above ``more_than`` only, and at each
    count the configurations of ``candidates``. Offload is tried only when
    ``offload`` is set (True: only with it; None: without first): it trades
    step time for memory, a choice left to the caller. ``kwargs`` go to
    ``candidates`` (a ``zero_stage`` or ``rollout_gpus`` given holds at every
    count). None when 16 GPUs (or 8 rollout GPUs) do not suffice."""
    kind, _ = parse_gpus(gpu)
    for n in GPU_COUNTS:
        if n > more_than:
            found = candidates(p, mode, f"{n}x{kind}", offload=offload, **kwargs)
            fit = next((c for c in found if c.fits), None)
            if fit is not None:
                return fit
    return None
