"""Settings of one rollout server process (``TANDEM_ROLLOUT_*`` on top of ``services.settings``).

The run config (``RunConfig``) says *what* to generate (model, sampling,
staleness); these settings say how this process runs its engine and how much
load it accepts. Everything here has a default that works on a 2-core CPU
machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from services.settings import WorkerSettings, settings_config


class RolloutSettings(WorkerSettings):
    """`tandem serve rollout`: ``TANDEM_ROLLOUT_*``."""

    model_config = settings_config("TANDEM_ROLLOUT_")

    model: Path | None = None
    """Model directory to serve without a run config (`tandem serve rollout --model DIR`)."""
    reward_url: str = "http://127.0.0.1:8002"
    """Reward server the actor loop scores completions with; its sandboxes run episodes' python tool (actor and
    `/v1/generate`)."""
    reward_token: SecretStr | None = None
    """Bearer token the actor loop sends to the reward server (TANDEM_ROLLOUT_REWARD_TOKEN). Unset:
    TANDEM_TOKEN. docker-compose gives the reward server, which runs untrusted code, a token of its
    own that no other service accepts; this is how the rollout server gets it."""

    max_n: int = Field(default=256, ge=1)
    """Largest ``n`` one ``/v1/generate`` request may ask for (above: 422)."""
    max_pending_seqs: int = Field(default=1024, ge=1)
    """Sequences (sum of ``n``) that HTTP requests may have in the engine at once; a
    request that would go beyond gets 503 with Retry-After instead of queueing without bound."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length of the engine (prompt + completion). Default: the run config's
    ``model.max_model_len``, else the model's own limit."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        default=None
    )
    """Engine dtype. Default: the run config's ``model.dtype``, else the checkpoint's own dtype
    (``config.json``); vLLM's ``auto`` would serve float32 checkpoints in bfloat16 on CPU."""
    enforce_eager: bool = Field(default=False)
    """Skip torch.compile / CUDA graphs. Default: compiled, as vLLM's own default. On CPU the
    compiled model took 6-11% less CPU per generated sample at the example's size (quiet) and its
    runs' training steps 11-13% less time (docs/performance.md), for a start about 10-25 s longer
    (vLLM's warm-up and compile pass; the compiled graph is cached under ~/.cache/vllm). True
    skips it, and on CPU with an explicit KV-cache size the warm-up pass too: the engine answers
    seconds after it starts (the tests' engines)."""
    kv_cache_gib: float | None = Field(default=None, gt=0)
    """KV-cache size in GiB (vLLM ``kv_cache_memory_bytes``). Default on CPU: the
    ``VLLM_CPU_KVCACHE_SPACE`` environment variable, else 1 GiB; on GPU vLLM's own sizing."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of accelerator memory vLLM may take (GPU only)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one model replica is split over (vLLM ``tensor_parallel_size``). On Modal the deploy
    section's layout sets it (``deploy.layout.rollout_env``)."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Model replicas this engine runs (vLLM ``data_parallel_size``), each over ``tensor_parallel_size``
    GPUs. Set by the deploy section's layout, as ``tensor_parallel_size``."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Sequences the engine batches in one step (vLLM ``max_num_seqs``); default vLLM's."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(default="processed_logprobs")
    """Which log-probabilities ``Sample.logprobs`` holds. ``processed_logprobs`` (default):
    of the distribution actually sampled from (``softmax(logits / T)`` after min_tokens, top-k
    and top-p), the behaviour policy the learner's ratio needs (it divides its logits by T).
    ``raw_logprobs``: log-softmax of the model's logits whatever the sampling parameters
    (the temperature-1 policy). Each trajectory group carries the mode; a run whose sampling
    processes the logits (temperature != 1, top-k, top-p, min_tokens) is refused by such a
    server and its groups by the learner."""
    lora_rank: int | None = Field(default=None, ge=1)
    """Serve weight versions as LoRA adapters up to this rank (vLLM ``enable_lora``; see
    ``rollout_server.adapters``). Default: the run config's ``learner.lora.r`` when it has
    ``publish.lora_format = "adapter"``, else full weights. Set it for a server started without a run
    config (``tandem up``'s stack) that is to serve adapter runs."""
    seed: int = Field(default=0)
    """Engine seed (requests without a seed draw from it)."""
    vllm_spin_s: float | None = Field(default=0.05, ge=0)
    """How long vLLM's engine core and workers spin on their shared-memory queue after a message before
    they sleep until the next (``rollout_server.vllm_plugin``). vLLM's own is 1 s: between two waves of
    groups the idle engine would keep a core busy that the learner could use. None: vLLM's own."""
    engine_stats: bool = Field(default=False)
    """vLLM's scheduler statistics as the ``tandem_rollout_running_requests``,
    ``tandem_rollout_waiting_requests`` and ``tandem_rollout_kv_cache_usage`` gauges. Off by default:
    with them vLLM computes statistics at every step, in its engine core and for every request's
    output in the server (docs/performance.md, "2026-12-07: the rollout server's own CPU")."""
    actor_concurrency: int = Field(default=32, ge=1)
    """Prompt groups the actor loop keeps in the engine at once (they batch together).
    Admission capacity bounds it too."""
    score_timeout_s: float = Field(default=120.0, gt=0)
    """Per-attempt timeout of the reward server's ``POST /v1/score``."""
    tools: dict[str, str] = Field(default_factory=dict)
    """User tools an episode may call (TANDEM_ROLLOUT_TOOLS, JSON ``{"name": "module:function"}``): Python
    functions importable here, never sent as code; they run in worker processes of their own
    (``rollout_server.tool_pool``)."""
    tool_workers: int = Field(default=4, ge=1)
    """User-tool calls this server runs at once, each in a worker process of its own; further calls wait for
    a free worker within their own timeout, so no prompt set can make more tool processes run."""
    tool_timeout_s: float = Field(default=60.0, gt=0)
    """Longest one tool call may take (user tools and ``python``): a line's ``episode.tool_timeout_s`` above
    it is lowered to it. A user tool past it has its worker process killed."""
    tool_episode_s: float = Field(default=300.0, gt=0)
    """Tool time one episode may spend over all its calls: a line's ``episode.tool_budget_s`` above it (or
    unset) is lowered to it; once it is spent, further calls are answered with an error."""
    fatal_grace_s: float = Field(default=2.0, ge=0)
    """After the engine dies, how long /healthz reports 503 before the process exits (non-zero)."""

    @property
    def reward_bearer(self) -> str | None:
        """The token for the reward server: ``reward_token``, else ``token``."""
        secret = self.reward_token or self.token
        return secret.get_secret_value() if secret else None
