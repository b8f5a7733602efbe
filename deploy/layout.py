"""Where a run's processes sit on GPUs: one description, and the one place that turns it into arguments.

A :class:`Layout` is the learner's GPUs (nodes x GPUs per node, one DeepSpeed rank each) and the
rollout fleet (servers, each one vLLM engine over ``tensor_parallel x data_parallel`` GPUs of its
own), colocated or not. ``deploy.config.layout_of`` reads it from the Modal deploy section
(the ``[modal]`` table; this module knows nothing of that table's types); on Modal the two never share GPUs: the rollout servers
and the learner are separate containers. From a layout:

- :func:`vllm_args`: the engine's ``tensor_parallel_size`` and ``data_parallel_size``, which reach
  the rollout server as :func:`rollout_env` (``TANDEM_ROLLOUT_TENSOR_PARALLEL_SIZE``, ...) and from
  its settings ``rollout_server.engine.parallel_engine_args``;
- :func:`deepspeed_settings`: the learner's world size (torchrun's nodes x processes per node) and,
  with the run's ``[learner]`` section, its ZeRO stage and offload;
- :func:`modal_gpus`: the GPU string of each Modal function (``"H100:2"``) and its count (rollout
  containers kept up; learner nodes);
- :func:`plan_args`: what the memory planner (``deploy/plan.py``) is told, so that it plans this
  layout and no other.

``tests/unit/deploy/test_layout.py`` checks, for every preset in ``examples/presets/`` and its deploy
section in ``examples/presets/modal/``, that these agree with what the planner assumed and with what
the engine, the learner and the Modal app are given. Pure data; no torch, no Modal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from services.config import LearnerConfig


class Layout(BaseModel):
    """The learner's GPUs and the rollout fleet of one run."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    learner_gpu: str
    """GPU type of the learner, as Modal spells it (``"H100"``)."""
    learner_gpus_per_node: int = Field(ge=1, le=8)
    """GPUs (DeepSpeed ranks) per learner node."""
    learner_nodes: int = Field(default=1, ge=1)
    """Learner nodes (a clustered job when more than one)."""
    rollout_gpu: str
    """GPU type of each rollout server."""
    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs one vLLM model replica is split over (vLLM ``tensor_parallel_size``)."""
    data_parallel: int = Field(default=1, ge=1)
    """Model replicas inside one rollout server (vLLM ``data_parallel_size``)."""
    rollout_servers: int = Field(default=1, ge=1)
    """Rollout servers (containers) kept up: the actor fleet."""
    colocated: bool = False
    """True when the rollout engine shares the learner's GPUs (one machine running both, as
    ``tandem up`` does on a GPU host); never on Modal."""

    @model_validator(mode="after")
    def _consistent(self) -> Layout:
        if self.colocated and (self.rollout_gpu != self.learner_gpu or self.learner_nodes != 1
                               or self.rollout_gpus_per_server != self.learner_gpus_per_node):
            raise ValueError("a colocated layout serves on the learner's own GPUs: one node, the same type, "
                             "tensor_parallel x data_parallel = the learner's GPUs")
        return self

    @property
    def learner_world_size(self) -> int:
        return self.learner_nodes * self.learner_gpus_per_node

    @property
    def rollout_gpus_per_server(self) -> int:
        return self.tensor_parallel * self.data_parallel


def gpu_type_and_count(gpu: str) -> tuple[str, int]:
    """A Modal GPU string ``TYPE[:COUNT]`` -> ``(TYPE, COUNT)``."""
    kind, _, count = gpu.partition(":")
    return kind, int(count or 1)


def vllm_args(layout: Layout) -> dict[str, int]:
    """The vLLM engine arguments of one rollout server."""
    return {"tensor_parallel_size": layout.tensor_parallel, "data_parallel_size": layout.data_parallel}


def rollout_env(layout: Layout) -> dict[str, str]:
    """How :func:`vllm_args` reaches a rollout server: its settings (``rollout_server.settings``)."""
    return {f"TANDEM_ROLLOUT_{key.upper()}": str(value) for key, value in vllm_args(layout).items()}


def deepspeed_settings(layout: Layout, learner: LearnerConfig) -> dict:
    """The learner's DeepSpeed job: torchrun's shape (world size = nodes x processes per node, one rank
    per GPU) and the ZeRO settings of the run's ``[learner]`` section."""
    return {"world_size": layout.learner_world_size, "nodes": layout.learner_nodes,
            "nproc_per_node": layout.learner_gpus_per_node, "zero_stage": learner.zero_stage,
            "offload_optimizer": learner.offload_optimizer, "offload_params": learner.offload_params}


def modal_gpus(layout: Layout) -> dict[str, dict]:
    """Each Modal function's GPU string and count: ``rollout`` containers kept up, ``learner`` nodes."""
    if layout.colocated:
        raise ValueError("a colocated layout is not a Modal deployment (there rollout and learner are separate "
                         "containers)")
    return {"rollout": {"gpu": f"{layout.rollout_gpu}:{layout.rollout_gpus_per_server}",
                        "containers": layout.rollout_servers},
            "learner": {"gpu": f"{layout.learner_gpu}:{layout.learner_gpus_per_node}",
                        "nodes": layout.learner_nodes}}


def plan_args(layout: Layout) -> dict:
    """The memory planner's layout arguments (``deploy.plan.plan``): the learner's GPUs and, unless
    colocated, the GPUs of one rollout model replica."""
    args: dict = {"gpus": f"{layout.learner_world_size}x{layout.learner_gpu}", "colocated": layout.colocated}
    if not layout.colocated:
        args["rollout_gpus"] = f"{layout.tensor_parallel}x{layout.rollout_gpu}"
    return args
