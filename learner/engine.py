"""The DeepSpeed engine around a Hugging Face causal LM.

One :class:`LearnerEngine` per rank. It loads ``model.path`` with
``AutoModelForCausalLM`` (optionally wrapped in a peft LoRA adapter), hands
it to ``deepspeed.initialize`` with ZeRO stage 0-3, optimizer/parameter
offload, fp32/bf16 and activation checkpointing from ``[learner]``, and
offers the four things the trainer needs:

- :meth:`train_step`: one optimizer step over this rank's share of a batch,
  micro-batched by token budget with gradient accumulation (DeepSpeed's
  accumulation boundary is set by hand because the number of micro-batches
  varies per step; every rank runs the same number, see ``learner.batch``).
  Micro-batches are padding-free by default (the ``learner.packing`` setting:
  one packed row, whose attention ``learner/packing.py`` keeps within each
  sequence), and the log-probs come from the final hidden states a chunk of
  tokens at a time (``learner/logits.py``), never the whole micro-batch's logits;
- :meth:`full_state_dict`: the full weights in Hugging Face naming on rank 0
  (ZeRO-3 parameters gathered module by module with ``GatheredParameters``;
  LoRA merged into the base weights), for publishing;
- :meth:`save` / :meth:`load`: DeepSpeed checkpoints plus the learner's own
  state and each rank's RNG state, committed by an atomically written
  pointer file (a checkpoint killed half-way is never loaded);
- a frozen reference model when ``loss.beta > 0``: the adapter-disabled
  base model under LoRA (no copy), else a second copy, ZeRO-3-sharded when
  the policy is (TRL's approach), otherwise replicated without gradients.

The process group and its bounded collectives are :mod:`learner.distributed`;
the RNG state saved with a checkpoint :mod:`learner.rng`.

Watchdogs (``[watchdog]``, ``services.watchdog``): every collective is named
(:func:`learner.distributed.collective`: one whose peer rank stopped answering
fails past ``watchdog.collective_s``). Each step, publish gather and checkpoint
save runs under a :class:`~services.watchdog.Watchdog` of
``watchdog.step_s``: a thread stuck inside DeepSpeed cannot be interrupted,
so past the bound the rank logs its stack, records the incident and exits
with ``EXIT_STALLED``; the supervisor restarts the learner, which resumes
from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch

from host.files import write_atomic
from learner.batch import TrainSeq, bucket, collate, pack
from learner.borrowed_cores import BorrowedCores
from learner.crash import crash_point
from learner.distributed import collective, init_distributed
from learner.logits import chunk_count, scored_logprobs, spread, stop_token_ids
from learner.loss import LossStats, token_loss
from learner.packing import packing_error
from learner.packing import register as register_packed_attention
from learner.rng import load_rng_state, rng_state, seed_everything, set_rng_state
from services import watchdog
from services.config import RunConfig
from services.timeline import Timeline

log = logging.getLogger("tandem.learner")

POINTER = "tandem-latest"
STATE_FILE = "learner-state.json"


def ds_config(cfg: RunConfig) -> dict:
    """The DeepSpeed config dict of a run's ``[learner]`` section."""
    lc = cfg.learner
    zero: dict = {"stage": lc.zero_stage}
    if lc.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if lc.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if lc.zero_stage == 3:
        # publish gathers parameters explicitly; the 16-bit consolidated save is not used
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return {
        # the trainer decides the batch; DeepSpeed sees one "sample" per micro-step and
        # the accumulation boundary is set by hand (see LearnerEngine.train_step)
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": lc.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        # a torch AdamW everywhere keeps all stages numerically comparable
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class LearnerEngine:
    """A DeepSpeed-wrapped policy (and reference) on this rank."""

    def __init__(self, cfg: RunConfig, incidents: watchdog.SyncIncidentLog | None = None) -> None:
        """``incidents``: the run's incidents stream, where a watchdog of this rank records what it saw."""
        t0 = time.monotonic()
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        t_imports = time.monotonic()
        self.rank, self.world = init_distributed(cfg.watchdog.collective_s)
        t_group = time.monotonic()
        self.incidents = incidents
        self.watchdog = watchdog.Watchdog(sink=incidents, source=f"learner:rank{self.rank}")
        self.steps_taken = 0
        self.timeline = Timeline.off()
        self.cores: BorrowedCores | None = None
        """Set by the trainer where the learner may borrow the rollout server's cores (``learner.borrowed_cores``)."""
        """Spans of the step's parts (rank 0's trainer sets the run's; services.timeline)."""
        self.device = torch.device(get_accelerator().current_device_name())
        self._host: dict[str, torch.Tensor] = {}  # pinned host copies of the published weights (see _to_host)
        self.host_buffers = self.device.type == "cuda"
        """Gather published weights into host buffers reused at every publish (:meth:`_to_host`): on a GPU;
        a test sets it on CPU to run that path."""
        seed_everything(cfg.learner.seed)
        lc = cfg.learner
        self.packed = lc.packing
        # packed micro-batches need attention that stays within each sequence (learner.packing)
        attention = {"attn_implementation": register_packed_attention()} if self.packed else {}
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, **attention)
        t_model = time.monotonic()
        model.config.use_cache = False
        self.vocab_size = model.config.vocab_size
        self.max_len = int(getattr(model.config, "max_position_embeddings", cfg.model.max_model_len))
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.stops = torch.tensor(stop_token_ids(cfg.model.path), dtype=torch.long, device=self.device) \
            if cfg.sampling.min_tokens else None
        """The end tokens the sampler holds back before ``sampling.min_tokens`` (``learner.logits``)."""
        if lc.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lc.lora is not None
        if self.lora and (why := tied_lora_refusal(model, lc.lora.target_modules)) is not None:
            raise ValueError(f"learner.lora.target_modules: {why}")
        if self.lora:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            model = get_peft_model(
                model,
                PeftLoraConfig(
                    r=lc.lora.r, lora_alpha=lc.lora.alpha, lora_dropout=lc.lora.dropout,
                    target_modules=list(lc.lora.target_modules), task_type="CAUSAL_LM",
                ),
            )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay)
        warmup = lc.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        t_ds = time.monotonic()
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(cfg)
        )
        t_ds = time.monotonic() - t_ds
        self.zero_stage = lc.zero_stage
        self.ref = None
        if cfg.loss.beta > 0 and not self.lora:
            ref = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, **attention)
            ref.config.use_cache = False
            ref.requires_grad_(False)
            if lc.zero_stage == 3:
                ref_cfg = {
                    "train_micro_batch_size_per_gpu": 1,
                    "zero_optimization": {"stage": 3, **({"offload_param": {"device": "cpu"}} if lc.offload_params else {})},
                    "bf16": {"enabled": lc.precision == "bf16"},
                }
                self.ref, *_ = deepspeed.initialize(model=ref, config=ref_cfg)
            else:
                dtype = torch.bfloat16 if lc.precision == "bf16" else torch.float32
                self.ref = ref.to(self.device, dtype=dtype)
            self.ref.eval()
        self.head = _output_head(self.engine.module)
        self.ref_head = _output_head(self.ref) if self.ref is not None else None
        if self.packed:
            self.engine.eval()
            why = packing_error(self.engine, self.vocab_size, self.device)
            self.engine.train()
            if why is not None:
                log.warning("learner.packing: %s; training on padded micro-batches instead", why)
                self.packed = False
        log.info("engine up in %.1f s (imports %.1f s, process group %.1f s, model %.1f s, deepspeed.initialize "
                 "%.1f s)", time.monotonic() - t0, t_imports - t0, t_group - t_imports, t_model - t_group, t_ds)

    # -- training ------------------------------------------------------------

    def _scored(self, module, head: torch.nn.Module, batch: dict, chunks: int,
                entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and entropies ``[B, T]`` (zero off the completion tokens) of ``batch`` under
        ``module``, whose output head is ``head``; ``entropy`` as :func:`learner.logits.scored_logprobs`."""
        if self.packed:
            shape = {"position_ids": batch["position_ids"], "packed_seq_lens": batch["seq_lens"]}
        else:
            shape = {"attention_mask": batch["attention_mask"]}
        # the model's own head runs on one position only (logits_to_keep=1); learner.logits applies
        # it, the temperature and the log-softmax to the final hidden states a chunk at a time
        out = module(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=1, output_hidden_states=True,
                     **shape)
        logp, ent = scored_logprobs(out.hidden_states[-1], head, batch["index"], batch["tokens"],
                                    temperature=self.cfg.sampling.temperature, chunks=chunks, entropy=entropy,
                                    held=batch.get("held"), stops=self.stops)
        return spread(logp, batch["mask"]), None if ent is None else spread(ent, batch["mask"])

    def _ref_logp(self, batch: dict, chunks: int) -> torch.Tensor:
        with torch.no_grad():
            if self.lora:
                with self.engine.module.disable_adapter():
                    return self._scored(self.engine, self.head, batch, chunks, "none")[0]
            return self._scored(self.ref, self.ref_head, batch, chunks, "none")[0]

    def micro_batches(self, seqs: list[TrainSeq]) -> list[tuple[list[TrainSeq], int]]:
        """This rank's micro-batches, padded with empty ones to the count of the busiest rank, each
        with the number of logit chunks (``learner.logits``) all ranks agree on for it: under ZeRO-3
        every call of the output head gathers its weight, collectively."""
        lc = self.cfg.learner
        mbs = (pack if self.packed else bucket)(seqs, lc.micro_batch_tokens)
        # on the accelerator: NCCL reduces device tensors only (gloo takes either)
        n = torch.tensor([len(mbs)], dtype=torch.long, device=self.device)
        with self._collective("all_reduce(MAX) of the micro-batch count", in_step=True):
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
        mbs = mbs + [[] for _ in range(int(n) - len(mbs))]
        chunks = torch.tensor([chunk_count(sum(s.scored for s in mb), lc.logit_chunk_tokens) for mb in mbs],
                              dtype=torch.long, device=self.device)
        with self._collective("all_reduce(MAX) of the logit chunk counts", in_step=True):
            torch.distributed.all_reduce(chunks, op=torch.distributed.ReduceOp.MAX)
        return list(zip(mbs, chunks.tolist(), strict=True))

    # -- watchdogs ---------------------------------------------------------------

    @contextmanager
    def _bounded(self, what: str) -> Iterator[None]:
        """``what`` (a step, a gather, a save) within ``watchdog.step_s``, else this rank exits."""
        with self.watchdog.guard(f"learner rank {self.rank} of {self.world}: {what}",
                                 "DeepSpeed (the other ranks, or this rank's own computation)",
                                 limit_s=self.cfg.watchdog.step_s, field="watchdog.step_s",
                                 action="this rank exits for a restart (the learner resumes from its checkpoint)"):
            yield

    def _collective(self, name: str, *, in_step: bool = False) -> AbstractContextManager[None]:
        """:func:`collective`, naming the step when ``in_step`` (the step being taken)."""
        return collective(name, step=self.steps_taken + 1 if in_step else None, incidents=self.incidents)

    # -- training ----------------------------------------------------------------

    def train_step(self, seqs: list[TrainSeq]) -> dict[str, float]:
        """One optimizer step on this rank's rows; returns batch-wide statistics (all ranks)."""
        with self._bounded(f"optimizer step {self.steps_taken + 1}"):
            out = self._train_step(seqs)
        self.steps_taken += 1
        return out

    def _train_step(self, seqs: list[TrainSeq]) -> dict[str, float]:
        cfg = self.cfg
        self.engine.train()
        mbs = self.micro_batches(seqs)
        local = LossStats()
        for i, (mb, chunks) in enumerate(mbs):
            if self.cores is not None:
                self.cores.apply()
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate(mb, self.pad_id, packed=self.packed,
                                         min_tokens=cfg.sampling.min_tokens).items()}
            self.engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            with self.timeline.span("forward", "rank0", micro_batch=i):
                logp, entropy = self._scored(self.engine, self.head, batch, chunks,
                                             "grad" if cfg.loss.entropy_coef > 0 else "value")
                ref_logp = self._ref_logp(batch, chunks) if cfg.loss.beta > 0 else None
                loss, st = token_loss(
                    cfg.loss, logp=logp, behav_logp=batch["behav"], advantages=batch["advantages"],
                    mask=batch["mask"], coef=batch["coef"], ref_logp=ref_logp, entropy=entropy,
                )
            # c_{i,t} already normalises over the whole batch; DeepSpeed averages gradients
            # over data-parallel ranks, so scale by the world size to keep a sum
            with self._collective("backward (DeepSpeed's gradient all-reduce / ZeRO reduce-scatter)", in_step=True), \
                    self.timeline.span("backward", "rank0", micro_batch=i):
                self.engine.backward(loss * self.world, scale_wrt_gas=False)
            local.merge(st)
        if self.cores is not None:
            self.cores.apply()
        with self._collective("optimizer step (DeepSpeed's gradient reduction / ZeRO all-gather)", in_step=True), \
                self.timeline.span("optimizer", "rank0"):
            self.engine.step()
        total = torch.tensor(local.as_vector(), dtype=torch.float64, device=self.device)
        wmax = torch.tensor([local.is_weight_max], dtype=torch.float64, device=self.device)
        with self._collective("all_reduce of the step statistics", in_step=True):
            torch.distributed.all_reduce(total)
            torch.distributed.all_reduce(wmax, op=torch.distributed.ReduceOp.MAX)
        out = LossStats.from_vector(total.tolist(), float(wmax)).summary()
        norm = self.engine.get_global_grad_norm()
        # DeepSpeed reports the norm for ZeRO >= 1; without ZeRO it keeps none (None in the stats)
        out["grad_norm"] = float(norm) if norm is not None else None
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        out["micro_batches"] = len(mbs)
        if self.cores is not None:
            out["cores_lent_frac"] = self.cores.lent_frac()
        return out

    # -- weights ---------------------------------------------------------------

    def full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Full weights in Hugging Face naming on rank 0 (empty on other ranks). Collective."""
        with self._bounded("gather of the full weights for publishing"), \
                self._collective("ZeRO-3 parameter gather for publishing"):
            return self._full_state_dict(dtype)

    def _full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        import deepspeed

        module = self.engine.module
        gather = self.zero_stage == 3
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()  # tied weights (lm_head = embed_tokens) are written once
        lora_layers = {}
        if self.lora:
            from peft.tuners.lora import LoraLayer

            lora_layers = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
        for mod_name, mod in module.named_modules():
            if mod_name in lora_layers:
                m = lora_layers[mod_name]
                with deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=None, enabled=gather):
                    if self.rank == 0:
                        base = m.get_base_layer()
                        w = base.weight.detach().float() + m.get_delta_weight("default").detach().float()
                        key = _hf_name(f"{mod_name}.weight")
                        out[key] = w.to("cpu", dtype=dtype)
                        seen.add(id(base.weight))
                        if getattr(base, "bias", None) is not None:
                            out[_hf_name(f"{mod_name}.bias")] = base.bias.detach().to("cpu", dtype=dtype).clone()
                            seen.add(id(base.bias))
                continue
            if any(_inside(mod_name, ln) for ln in lora_layers):
                continue  # base layer and adapter matrices of a LoRA layer: merged above
            own = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
            if not own:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None, enabled=gather):
                for n, p in own:
                    seen.add(id(p))
                    if self.rank == 0:
                        key = _hf_name(f"{mod_name}.{n}" if mod_name else n)
                        out[key] = self._to_host(key, p.detach(), dtype, copy=gather)
                if self.rank == 0 and self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # copies done before ZeRO-3 releases the gathered
        if self.rank == 0:
            # transformers 5 fuses some checkpoint tensors when it loads a model (an MoE layer's
            # experts become mlp.experts.gate_up_proj / down_proj); readers of a published version
            # (vLLM, from_pretrained) expect the checkpoint's layout (mlp.experts.N.*_proj.weight)
            from transformers.core_model_loading import revert_weight_conversion

            base = module.get_base_model() if self.lora else module
            out = revert_weight_conversion(base, out)
        return out

    def _to_host(self, key: str, t: torch.Tensor, dtype: torch.dtype, *, copy: bool) -> torch.Tensor:
        """``t`` as ``dtype`` in host memory, for writing. With :attr:`host_buffers` (a GPU): into a
        pinned buffer kept for the next publish, asynchronously (the caller synchronizes), so the
        tensors returned are valid until the next publish refills them: the publisher waits for a
        version's files before it gathers the next (``learner.publisher``). bench/transfer.py on an
        H200, 15.8 GB of bf16: pageable ``.to("cpu")`` 10.7 s (1.5 GB/s), pinned 0.29 s (55 GB/s); the
        buffers cost the model's size in pinned host memory on rank 0. On CPU: the tensor itself when
        it already has ``dtype`` (written before the next step changes it) unless ``copy`` (a gathered
        ZeRO-3 parameter is released when its context exits)."""
        if self.host_buffers:
            buf = self._host.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != dtype:
                buf = self._host[key] = torch.empty(t.shape, dtype=dtype, pin_memory=t.is_cuda)
            return buf.copy_(t, non_blocking=t.is_cuda)
        host = t.to("cpu", dtype=dtype)
        return host.clone() if copy and host.data_ptr() == t.data_ptr() else host

    def adapter_state_dict(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], str]:
        """The LoRA adapter in PEFT's saved naming and its ``adapter_config.json`` text (rank 0). Collective."""
        with self._bounded("gather of the LoRA adapter for publishing"), \
                self._collective("ZeRO-3 adapter gather for publishing"):
            return self._adapter_state_dict(dtype)

    def _adapter_state_dict(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], str]:
        import deepspeed

        module = self.engine.module
        out: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            if "lora_" not in name:
                continue
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None, enabled=self.zero_stage == 3):
                if self.rank == 0:
                    out[name.replace(".default.", ".")] = p.detach().to("cpu", dtype=dtype).clone()
        config = module.peft_config["default"].to_dict()
        config["base_model_name_or_path"] = str(self.cfg.model.path)
        return out, json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v), indent=1)

    # -- checkpoints -------------------------------------------------------------

    def save(self, ckpt_dir: str | Path, tag: str, state: dict, keep: int = 2) -> None:
        """Save a resumable checkpoint ``tag`` with the learner ``state``. Collective.

        The pointer file is replaced (atomically) only after every rank's
        files are written, so a kill mid-save leaves the previous checkpoint
        in force.
        """
        with self._bounded(f"checkpoint save {tag}"), \
                self._collective(f"checkpoint save {tag} (DeepSpeed's and the pointer's barriers)"):
            self._save(Path(ckpt_dir), tag, state, keep)

    def _save(self, ckpt_dir: Path, tag: str, state: dict, keep: int) -> None:
        from services.weightstore import RunDirectoryFull, free_bytes

        tag_dir = ckpt_dir / tag
        try:
            self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={}, save_latest=False)
            torch.save(rng_state(), tag_dir / f"rng-rank{self.rank}.pt")
            crash_point("saving", _tag_step(tag_dir), ckpt_dir)  # files written, pointer not yet
        except Exception as e:
            shutil.rmtree(tag_dir, ignore_errors=True)  # half a checkpoint: the pointer never names it
            pointer = ckpt_dir / POINTER
            previous = ckpt_dir / pointer.read_text().strip() if pointer.exists() else None
            needed = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()) \
                if previous is not None and previous.is_dir() else 0
            free = free_bytes(ckpt_dir)
            if needed and free is not None and free < needed:  # torch reports ENOSPC as "unexpected pos"
                raise RunDirectoryFull(ckpt_dir, free, needed, what="the checkpoint") from e
            raise
        torch.distributed.barrier()
        if self.rank == 0:
            write_atomic(tag_dir / STATE_FILE, json.dumps(state))
            write_atomic(ckpt_dir / POINTER, tag)
            tags = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step")), key=_tag_step)
            for old in tags[:-keep]:
                if old.name != tag:
                    shutil.rmtree(old)
        torch.distributed.barrier()

    def load(self, ckpt_dir: str | Path) -> dict | None:
        """Load the checkpoint the pointer names; return the learner state, or None if there is none."""
        ckpt_dir = Path(ckpt_dir)
        pointer = ckpt_dir / POINTER
        if not pointer.exists():
            return None
        tag = pointer.read_text().strip()
        path, _ = self.engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
        state = json.loads((ckpt_dir / tag / STATE_FILE).read_text())
        self.steps_taken = int(state.get("step", 0))
        rng = ckpt_dir / tag / f"rng-rank{self.rank}.pt"
        if rng.exists():
            set_rng_state(load_rng_state(rng))
        return state


def tied_lora_refusal(model: torch.nn.Module, targets: list[str]) -> str | None:
    """Why LoRA on ``targets`` cannot train ``model`` (a Hugging Face causal LM), or None.

    A model whose output head is tied to its input embeddings (``tie_word_embeddings``) is served by
    vLLM with one tensor for both. A LoRA on either one unties them in the learner (the adapter's delta
    reaches one use of the tensor, not the other), so no published version could be the learner's policy:
    vLLM would serve the merged head as the embedding too, or the other way round. Refused at start."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return None
    tied = {"output head": model.get_output_embeddings(), "input embedding": model.get_input_embeddings()}
    for name, module in model.named_modules():
        for what, tied_module in tied.items():
            hit = next((t for t in targets if name == t or name.endswith(f".{t}")), None)
            if module is tied_module and hit is not None:
                return (f"{hit!r} adapts {name}, the {what} of a model whose head is tied to its input embeddings "
                        "(tie_word_embeddings): vLLM serves one tensor as both, so the served policy would not be "
                        "the learner's; adapt other modules (e.g. the attention projections)")
    return None


def _output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output head (``lm_head``, the embedding when tied) of a Hugging Face causal LM, through a
    DeepSpeed engine and a peft wrapper; a LoRA on the head itself is part of the module returned."""
    model = getattr(model, "module", model)  # a DeepSpeed engine
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    return model.get_output_embeddings()


def _inside(name: str, parent: str) -> bool:
    return name.startswith(parent + ".")


def _hf_name(name: str) -> str:
    """Parameter name as the base model's checkpoint spells it (peft prefixes removed)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _tag_step(p: Path) -> int:
    digits = p.name.removeprefix("step")
    return int(digits) if digits.isdigit() else -1


