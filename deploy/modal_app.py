"""The tandem services as one deployed Modal app: the same processes ``tandem serve`` runs.

Who talks to whom (as in the local stack; docs/architecture.md section 1):

| function | Modal shape | runs |
|---|---|---|
| ``control`` | CPU, ``@modal.asgi_app`` | ``control_plane.build_app`` (what ``tandem serve control`` serves) |
| ``reward`` | CPU, ``@modal.asgi_app`` | ``reward_server.build_app`` with ``TANDEM_REWARD_SANDBOX=modal`` |
| ``Rollout.serve`` | GPU class, ``@modal.web_server`` | ``tandem serve rollout --config RUN.toml`` (vLLM + actor loop) |
| ``learner`` | ``H100:8`` (× nodes, ``@modal.clustered``) | ``torchrun ... -m deploy.cli serve learner --config RUN.toml`` |

Every entrypoint only builds settings and calls the local path's ``build_app``
or runs its ``tandem serve`` command line (``deploy.launch``); a unit test
checks the names each entrypoint calls. Redis is external: the Secret
``tandem`` must hold ``TANDEM_TOKEN`` and ``REDIS_URL`` (MODAL-NOTES section 5).
Weights, checkpoints and models live in the Volume ``tandem-runs``, mounted
at ``/runs`` (``TANDEM_RUN_DIR``) in every container; the run config is shipped
at its repository path under ``/``, so its ``../../runs/...`` paths land there.
The learner commits the Volume after writing each weight version and before
announcing it; a rollout server reloads it before reading one
(``TANDEM_RUN_DIR_VOLUME``, ``services.weightstore.commit_volume`` /
``reload_volume``).

Redis is not run inside the app: a container is reachable by others only
over i6pn within one region and must be discovered through a ``modal.Dict``,
and it is restarted at the 24 h timeout or on preemption (MODAL-NOTES
section 5). An external managed Redis (TLS, password) is the one supported
choice.

Rollout containers and the work: the actor loop *pulls* prompt groups from
Redis, so Modal's request-driven autoscaler does not see it. The actor fleet is
``[modal.rollout].min_containers`` (kept warm); containers above it start only
for ``/v1/generate`` traffic (evaluation) and stop after ``scaledown_window_s``.

Configuration (read when this module is imported, locally and in each container):

- ``DEPLOY_RUN_CONFIG``: the run config (default ``examples/arith/run.toml``);
- ``DEPLOY_MODAL_TOML``: an optional TOML file whose ``[modal]`` table is
  ``deploy.config.ModalDeploy`` (GPUs, nodes, containers, timeouts; default: its defaults).

Neither name starts with ``TANDEM_``: ``tandem serve`` refuses unknown ``TANDEM_*`` names.

Deploying (from the repository root, with ``modal token set`` done)::

    modal secret create tandem TANDEM_TOKEN=<token> REDIS_URL=rediss://:<password>@<host>:6379
    modal volume create tandem-runs
    tandem bootstrap-model --out runs/models/arith                  # builds the example policy locally
    modal volume put tandem-runs runs/models/arith models/arith     # -> /runs/models/arith
    DEPLOY_RUN_CONFIG=examples/arith/run.toml modal deploy -m deploy.modal_app
    python -c "import modal; modal.Function.from_name('tandem-arith', 'learner').spawn()"
    TANDEM_URL=https://<workspace>--tandem-arith-control.modal.run \
        tandem submit examples/arith/train.jsonl --config examples/arith/run.toml

The learner is a job, not a web endpoint: spawn it once after deploying
(it follows the run the control plane activates, as under ``tandem up``).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import modal

from deploy import launch
from deploy.config import (
    IMAGE_PACKAGES,
    RUN_DIR,
    ModalDeploy,
    gpu_count,
    load_deploy,
    role_env,
    role_options,
)
from services.config import load_run_config

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("services", "control_plane", "broker", "rollout_server", "reward_server", "learner", "deploy")

if modal.is_local():
    RUN_CONFIG = Path(os.environ.get("DEPLOY_RUN_CONFIG", REPO_ROOT / "examples" / "arith" / "run.toml"))
    REMOTE_CONFIG = launch.container_path(RUN_CONFIG, REPO_ROOT)
    SECTION = load_deploy(os.environ.get("DEPLOY_MODAL_TOML"))
else:  # in a container: the image carries the resolved choices (see _image)
    REMOTE_CONFIG = PurePosixPath(os.environ["DEPLOY_RUN_CONFIG"])
    RUN_CONFIG = Path(REMOTE_CONFIG)
    SECTION = ModalDeploy.model_validate_json(os.environ["DEPLOY_MODAL_SECTION"])

CONFIG = load_run_config(RUN_CONFIG)
APP_NAME = SECTION.app_name or f"tandem-{CONFIG.name}"

app = modal.App(APP_NAME)
runs = modal.Volume.from_name(SECTION.volume, create_if_missing=True)
VOLUMES = {RUN_DIR: runs}


def _image(role: str) -> modal.Image:
    """``role``'s image: Python 3.11, the pinned packages of its extras, then the code and run config
    (added last and not copied, so editing them rebuilds nothing)."""
    return (
        modal.Image.debian_slim(python_version="3.11")
        .uv_pip_install(*IMAGE_PACKAGES[role])
        .env({"DEPLOY_RUN_CONFIG": str(REMOTE_CONFIG), "DEPLOY_MODAL_SECTION": SECTION.model_dump_json()})
        .add_local_python_source(*SOURCES)
        .add_local_dir(RUN_CONFIG.parent, str(REMOTE_CONFIG.parent))
    )


def _secrets(role: str) -> list[modal.Secret]:
    return [modal.Secret.from_name(SECTION.secret, required_keys=["TANDEM_TOKEN", "REDIS_URL"]),
            modal.Secret.from_dict(role_env(SECTION, role))]


def _options(role: str) -> dict:
    """Everything ``@app.function`` / ``@app.cls`` gets for ``role``."""
    return {**role_options(SECTION, role), "image": _image(role), "volumes": VOLUMES,
            "secrets": _secrets(role)}


def _settings(cls):
    """``cls`` from this container's environment, checked as ``tandem serve`` checks it."""
    from deploy.cli import settings_classes
    from services.settings import check_environment

    check_environment(settings_classes().values())
    settings = cls()
    settings.check_auth_safe()
    return settings


@app.function(**_options("control"))
@modal.concurrent(max_inputs=SECTION.control.concurrency)
@modal.asgi_app(label=f"{APP_NAME}-control")
def control():
    """The control plane: REST API and dashboard."""
    from control_plane import build_app
    from services.settings import ControlSettings

    return build_app(_settings(ControlSettings), load_run_config(RUN_CONFIG))


@app.function(**_options("reward"))
@modal.concurrent(max_inputs=SECTION.reward.concurrency)
@modal.asgi_app(label=f"{APP_NAME}-reward")
def reward():
    """The reward server; code runs in Modal Sandboxes (``TANDEM_REWARD_SANDBOX=modal``)."""
    from reward_server import build_app
    from reward_server.settings import RewardSettings

    return build_app(_settings(RewardSettings), load_run_config(RUN_CONFIG))


@app.cls(**_options("rollout"))
@modal.concurrent(max_inputs=SECTION.rollout.concurrency)
class Rollout:
    """One rollout server (vLLM engine + actor loop) per container."""

    @modal.web_server(SECTION.rollout_port, startup_timeout=SECTION.rollout_startup_timeout_s,
                      label=f"{APP_NAME}-rollout")
    def serve(self):
        launch.start(launch.serve_argv("rollout", REMOTE_CONFIG), _rollout_env())


def _rollout_env() -> dict[str, str]:
    """What only the running container knows: its own name and the reward server's address."""
    return {"TANDEM_SERVER_ID": f"rollout-{os.environ.get('MODAL_TASK_ID', 'local')}",
            "TANDEM_ROLLOUT_REWARD_URL": reward.get_web_url()}


def _clustered(nodes: int):
    return modal.clustered(size=nodes) if nodes > 1 else (lambda f: f)


@app.function(**_options("learner"))
@_clustered(SECTION.learner.nodes)
def learner():
    """The learner job: every rank of ``nodes`` × GPUs under torchrun (rank 0 publishes weights)."""
    nodes, rank, master = SECTION.learner.nodes, 0, None
    if nodes > 1:
        cluster = modal.Cluster.from_context()
        rank, master = cluster.container_rank(), cluster.container_ips()[0]
    launch.run(launch.torchrun_argv(nodes=nodes, node_rank=rank, master_addr=master,
                                    nproc_per_node=gpu_count(SECTION.learner.gpu), config=REMOTE_CONFIG))
