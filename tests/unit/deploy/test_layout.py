"""One layout per preset: what the planner assumed is what the engine, DeepSpeed and Modal are given.

For every run config in ``examples/presets/`` and its deploy section in
``examples/presets/modal/`` (same file name): the layout of the section
(``deploy.config.layout_of``) is turned into the planner's arguments, and the
plan the preset notes (``#   tandem plan ...``, which test_presets checks is
the smallest fit) must be that plan; then each consumer is given what the
deployed app would give it, and must agree with the plan:

- vLLM: the rollout container's environment (``deploy.config.role_env``) read
  by ``RolloutSettings`` as ``tandem serve rollout`` reads it, then the engine's
  own ``parallel_engine_args``: tensor_parallel_size = the plan's rollout GPUs,
  and tensor x data parallel = the GPUs of the rollout container;
- DeepSpeed: torchrun's ranks as ``deploy.modal_app.learner`` starts them
  (nodes x ``gpu_count(learner.gpu)``) = the plan's learner GPUs, and the
  learner's ``ds_config`` ZeRO stage and offload = the plan's;
- Modal: ``role_options`` (what the decorators get) GPU strings, containers and
  nodes = ``deploy.layout.modal_gpus``; the rollout and learner are separate
  containers, so the plan is not colocated.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import layout as lay
from deploy import plan as planner
from deploy.config import gpu_count, layout_of, load_deploy, role_env, role_options
from deploy.launch import torchrun_argv
from deploy.presets import preset
from learner.engine import ds_config
from rollout_server.engine import parallel_engine_args
from rollout_server.settings import RolloutSettings
from services.config import load_run_config
from tests.unit.deploy.test_presets import FILES, noted_plan

DEPLOY_DIR = Path(__file__).resolve().parents[3] / "examples" / "presets" / "modal"


def test_one_deploy_section_per_preset():
    assert sorted(f.name for f in DEPLOY_DIR.glob("*.toml")) == [f.name for f in FILES]


def rollout_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> RolloutSettings:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return RolloutSettings()


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_planned_layout_is_the_deployed_one(path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = load_run_config(path)
    section = load_deploy(DEPLOY_DIR / path.name)
    layout = layout_of(section)
    opts = noted_plan(path)
    mode = "lora" if cfg.learner.lora is not None else "full"
    kwargs = dict(group_size=cfg.sampling.group_size, max_tokens=cfg.sampling.max_tokens,
                  micro_batch_tokens=cfg.learner.micro_batch_tokens, logit_chunk_tokens=cfg.learner.logit_chunk_tokens)
    if cfg.learner.lora is not None:
        kwargs["lora_rank"] = cfg.learner.lora.r

    # the planner: the layout's arguments are the noted plan's, and that plan fits
    args = lay.plan_args(layout)
    assert args["colocated"] is False and "colocated" not in opts
    assert planner.parse_gpus(args["gpus"]) == planner.parse_gpus(str(opts["gpus"]))
    assert planner.parse_gpus(args["rollout_gpus"]) == planner.parse_gpus(str(opts["rollout-gpus"]))
    plan = planner.plan(preset(cfg.model.path.name), mode, zero_stage=cfg.learner.zero_stage,
                        offload=cfg.learner.offload_optimizer, **args, **kwargs)
    assert plan.fits, f"{path.name}: {plan.label}: learner {plan.total:.1f} GB, rollout {plan.rollout:.1f} GB per GPU"

    # vLLM: what the rollout container's settings make of the deploy section's environment
    settings = rollout_settings(role_env(section, "rollout"), monkeypatch)
    engine = parallel_engine_args(settings)
    assert engine == lay.vllm_args(layout)
    assert engine["tensor_parallel_size"] == plan.rollout_gpus
    assert engine["tensor_parallel_size"] * engine["data_parallel_size"] == gpu_count(section.rollout.gpu)

    # DeepSpeed: torchrun's ranks as the Modal learner starts them, and the learner's ZeRO config
    argv = torchrun_argv(nodes=section.learner.nodes, node_rank=0, master_addr="10.0.0.1",
                         nproc_per_node=gpu_count(section.learner.gpu))
    nnodes = int(next(a for a in argv if a.startswith("--nnodes=")).split("=")[1])
    nproc = int(next(a for a in argv if a.startswith("--nproc-per-node=")).split("=")[1])
    ds = lay.deepspeed_settings(layout, cfg.learner)
    assert nnodes * nproc == ds["world_size"] == plan.gpus
    zero = ds_config(cfg)["zero_optimization"]
    assert zero["stage"] == ds["zero_stage"] == plan.zero_stage
    assert ("offload_optimizer" in zero) == ds["offload_optimizer"] == plan.offload
    assert ("offload_param" in zero) == ds["offload_params"] == (plan.offload and plan.zero_stage == 3)

    # Modal: the decorators' options, separate GPUs for the two roles
    modal = lay.modal_gpus(layout)
    for role in ("rollout", "learner"):
        kind, _ = planner.parse_gpus(role_options(section, role)["gpu"])
        assert role_options(section, role)["gpu"] == modal[role]["gpu"] and kind == plan.gpu == plan.rollout_gpu
    assert role_options(section, "rollout")["min_containers"] == modal["rollout"]["containers"] >= 1
    assert section.learner.nodes == modal["learner"]["nodes"]


def test_layout_of_splits_the_rollout_gpus_and_refuses_what_cannot_run():
    from deploy.config import ModalDeploy, RoleDeploy

    section = ModalDeploy(rollout=RoleDeploy(gpu="H100:4", min_containers=2, max_containers=4),
                          rollout_data_parallel=2, learner=RoleDeploy(gpu="H100:8", nodes=2))
    layout = layout_of(section)
    assert (layout.tensor_parallel, layout.data_parallel, layout.rollout_servers) == (2, 2, 2)
    assert layout.learner_world_size == 16 and not layout.colocated
    assert lay.rollout_env(layout) == {"TANDEM_ROLLOUT_TENSOR_PARALLEL_SIZE": "2",
                                       "TANDEM_ROLLOUT_DATA_PARALLEL_SIZE": "2"}
    assert lay.plan_args(layout) == {"gpus": "16xH100", "colocated": False, "rollout_gpus": "2xH100"}
    with pytest.raises(ValueError, match="does not divide"):
        ModalDeploy(rollout=RoleDeploy(gpu="H100:2", max_containers=1), rollout_data_parallel=4)
    shared = lay.Layout(learner_gpu="H100", learner_gpus_per_node=2, rollout_gpu="H100", tensor_parallel=2,
                        colocated=True)
    assert lay.plan_args(shared) == {"gpus": "2xH100", "colocated": True}
    with pytest.raises(ValueError, match="not a Modal deployment"):
        lay.modal_gpus(shared)
    with pytest.raises(ValueError, match="colocated layout serves on the learner's own GPUs"):
        lay.Layout(learner_gpu="H100", learner_gpus_per_node=2, rollout_gpu="H100", colocated=True)
