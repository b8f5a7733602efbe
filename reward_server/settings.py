"""Reward-server settings: ``TANDEM_REWARD_*`` on top of ``services.settings``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from services.settings import CommonSettings, settings_config

FUNCTION_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[\w*?]+$", re.ASCII)
"""An allow-list entry of ``functions``: ``module:name``, the module exact, the name an identifier or a glob."""


class RewardSettings(CommonSettings):
    """`tandem serve reward`: ``TANDEM_REWARD_*``."""

    model_config = settings_config("TANDEM_REWARD_")

    sandbox: Literal["auto", "gvisor", "bwrap", "modal", "none"] = "auto"
    """Code sandbox (TANDEM_REWARD_SANDBOX): auto = gVisor when runsc works, else bubblewrap, else none."""
    unsafe_local: bool = False
    """Run code on the host without a sandbox when none is usable (TANDEM_REWARD_UNSAFE_LOCAL). Never in production."""
    workers: int = Field(default=0, ge=0)
    """Programs run at once (0 = one per CPU core)."""
    max_queued: int = Field(default=0, ge=0)
    """Sandbox jobs admitted (running + waiting) before 429 (0 = 8 per worker)."""
    sandbox_python: str = "/usr/bin/python3"
    """Host interpreter whose runtime (binary, stdlib, shared libraries) is mounted into sandboxes."""
    max_jobs_per_sandbox: int = Field(default=500, ge=1)
    """gVisor/Modal: jobs one warm sandbox serves before it is replaced."""
    runsc: str = "runsc"
    """The gVisor runtime binary."""
    bwrap: str = "bwrap"
    """The bubblewrap binary."""
    math_workers: int = Field(default=1, ge=1)
    """math-verify worker processes."""
    math_timeout_s: float = Field(default=5.0, gt=0)
    """Longest one math-verify comparison may take before its worker is killed."""
    judge_url: str | None = None
    """Default OpenAI-compatible judge endpoint for judge specs without a url."""
    judge_api_key: SecretStr | None = None
    """Bearer token for the judge endpoint."""
    judge_timeout_s: float = Field(default=60.0, gt=0)
    """Per-request timeout of judge calls (the whole call: connect, send, reply)."""
    judge_allowed_urls: list[str] = Field(default_factory=list)
    """Judge base URLs a prompt set's judge spec may name as its ``url`` (TANDEM_REWARD_JUDGE_ALLOWED_URLS,
    JSON list, compared exactly up to a trailing slash). Empty (the default): specs may not name one and
    /v1/score answers 422. They never get the judge API key, which only goes to judge_url."""
    judge_max_reply_bytes: int = Field(default=1 << 20, ge=1024)
    """Judge replies longer than this are abandoned unread (judge_error)."""
    functions: list[str] = Field(default_factory=list)
    """Python reward functions a prompt set's ``python`` spec may name (TANDEM_REWARD_FUNCTIONS, JSON list of
    ``module:name`` patterns, e.g. ``["my_rewards:*", "scoring.code:passes"]``). The module is named exactly;
    the name may be a glob, which then allows only the public functions defined in that module. Empty (the
    default): none may be called, and /v1/score answers 422 naming the function. The modules must be
    importable here (an installed package, or on PYTHONPATH); they are imported at start-up in the workers."""
    function_workers: int = Field(default=2, ge=1)
    """Worker processes that call reward functions (each call is one batch: a group's completions)."""
    function_timeout_s: float = Field(default=30.0, gt=0)
    """Longest one reward-function call may take before its worker is killed and its completions get
    ``reward_error`` (the group is retried, then dropped)."""
    models: dict[str, Path] = Field(default_factory=dict)
    """Reward models a prompt set's ``reward_model`` spec may name (TANDEM_REWARD_MODELS, a JSON object of
    name -> folder, e.g. ``{"helpful": "/models/helpful-rm"}``): Hugging Face sequence-classification
    models with one label. Loaded once each, on first use, in a worker process of their own
    (``reward_server.verifiers.reward_models``). Empty (the default): every ``reward_model`` spec is refused."""
    model_device: str = "cpu"
    """Where the reward models run: ``cpu``, ``cuda``, ``cuda:1`` (TANDEM_REWARD_MODEL_DEVICE)."""
    model_batch_size: int = Field(default=32, ge=1)
    """Sequences one forward pass of a reward model takes."""
    model_max_tokens: int = Field(default=4096, ge=16)
    """Longest prompt + completion a reward model scores, in its tokens: a longer one is ``reward_error``
    (TRL does not cut them either), so one line cannot take the worker's memory."""
    model_timeout_s: float = Field(default=120.0, gt=0)
    """Longest one scoring call (a request's completions for one model, its first load included) may take
    before the worker is killed and those completions get ``reward_error``."""
    regex_timeout_s: float = Field(default=1.0, gt=0, le=60)
    """Longest one prompt-set regex (a regex spec's pattern, a judge spec's score_pattern) may match."""
    modal_app: str = "tandem-reward"
    """Modal app the sandboxes belong to (created if missing)."""
    modal_pool: int = Field(default=4, ge=1)
    """Warm Modal sandboxes kept."""
    modal_cpu: float = Field(default=1.0, gt=0)
    """CPU cores per Modal sandbox."""
    modal_memory_mb: int = Field(default=1024, ge=128)
    """Memory per Modal sandbox."""
    modal_spawns_per_s: float = Field(default=2.0, gt=0)
    """Creation rate limit for Modal sandboxes."""
    max_wall_s: float = Field(default=60.0, gt=0)
    """Ceiling on a request's ``limits.wall_s`` (limits come from untrusted prompt sets; above it: 422)."""
    max_cpu_s: float = Field(default=60.0, gt=0)
    """Ceiling on ``limits.cpu_s``."""
    max_memory_mb: int = Field(default=2048, ge=16)
    """Ceiling on ``limits.memory_mb``; also sizes each gVisor sandbox's host cgroup."""
    max_processes: int = Field(default=256, ge=1)
    """Ceiling on ``limits.processes``."""
    max_output_bytes: int = Field(default=16 << 20, ge=1024)
    """Ceiling on ``limits.output_bytes``."""
    max_file_bytes: int = Field(default=256 << 20, ge=1024)
    """Ceiling on ``limits.file_bytes``."""
    sandbox_cpus: float = Field(default=1.0, gt=0)
    """CPU cores one job (bubblewrap) or one warm sandbox (gVisor) may use at once (cgroup CPU quota)."""
    cgroups: bool = True
    """Cap each job's memory, processes and CPU with a host cgroup when this host allows it (root or a
    delegated subtree); false = per-process rlimits only. Whether cgroups are in use is logged at start-up."""

    @field_validator("functions")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not FUNCTION_PATTERN.match(pattern):
                raise ValueError(f"{pattern!r}: expected module:name, the module named exactly (a.b.c), "
                                 "the name an identifier or a glob (my_rewards:*)")
        return value

    @property
    def effective_workers(self) -> int:
        return self.workers or os.cpu_count() or 1

    @property
    def effective_max_queued(self) -> int:
        return self.max_queued or 8 * self.effective_workers
