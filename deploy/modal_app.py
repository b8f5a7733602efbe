"""The tandem services as one deployed Modal app: the same processes ``tandem serve`` runs.

Who talks to whom (as in the local stack; docs/architecture.md section 1):

| function | Modal shape | runs |
|---|---|---|
| ``control`` | CPU, ``@modal.asgi_app`` | ``control_plane.build_app`` (what ``tandem serve control`` serves), which spawns ``learner`` for each run it accepts |
| ``reward`` | CPU, ``@modal.asgi_app`` | ``reward_server.build_app`` with ``TANDEM_REWARD_SANDBOX=modal`` |
| ``RewardFunctions.run`` | CPU class, Restricted Function | the reward server's python reward functions (``function_worker``) |
| ``RewardModelWorker.score`` | class (GPU with ``[modal.models].gpu``), Restricted Function, memory snapshot | the reward models of ``[modal].reward_models`` (only when it lists some) |
| ``Rollout.serve`` | GPU class, ``@modal.web_server`` | ``tandem serve rollout --config RUN.toml`` (vLLM + actor loop) |
| ``learner`` | ``H100:8`` (× nodes, ``@modal.clustered``), a call per run, retried | ``torchrun ... -m deploy.cli serve learner`` for that run (``TANDEM_LEARNER_ONE_RUN``) |
| ``autoscale`` | CPU, scheduled | ``deploy.autoscale.tick``: sets ``Rollout``'s ``min_containers`` from the backlog |

Every service entrypoint only builds settings and calls the local path's ``build_app`` or runs
its ``tandem serve`` command line (``deploy.launch``); a unit test checks the names each
entrypoint calls. Redis is external. Secrets (``deploy.config.role_secret``): the Secret
``tandem`` holds ``TANDEM_TOKEN``, ``REDIS_URL`` and the reward server's token for its callers
(``TANDEM_ROLLOUT_REWARD_TOKEN``, ``TANDEM_CONTROL_REWARD_TOKEN``); the reward server gets only
the Secret ``tandem-reward`` (its own ``TANDEM_TOKEN``), no Redis and no volume: it handles
model-written code. It keeps Modal's API (it creates the Sandboxes the code runs in) and so runs no user
code itself: the python reward functions, which judge model-written completions, run in
``RewardFunctions``, a Restricted Function (``restrict_modal_access``: no Modal API, so nothing there can
mount the volume or attach a Secret to a Sandbox) with no Secret, no volume and no network unless
``[modal].functions_network``. Weights, checkpoints and models live in the Volume ``tandem-runs``, mounted
at ``/runs`` (``TANDEM_RUN_DIR``) in the other containers; the run config is shipped alone at
its repository path under ``/``, so its ``../../runs/...`` paths land there. The learner
commits the Volume after writing each weight version or checkpoint; a rollout server reloads
it before reading a version (``TANDEM_RUN_DIR_VOLUME``, ``services.weightstore``).

One learner per run: the control plane spawns ``learner(run_id)`` when it accepts a run
(``start_learner``). The call trains that run and returns when the run ends; Modal retries it
after a failure or its 24 h timeout (``[modal.learner].retries``), and the retry resumes from
the last checkpoint, after reloading the volume. The run's Redis lease (``broker.lease``, held
by the learner under the call's id and a part new in each attempt) keeps a second call, or an
attempt Modal gave up on, from training it too. Cancelling the call ends torchrun.
``max_containers`` is one cluster.

Signals: Modal sends SIGTERM to the container's main process; in the containers that run a
service process (rollout, learner) this module passes it on (``launch.forward_signals``, installed
when the container imports it), so the learner checkpoints and a rollout server releases its leases
before the container goes; the others serve in their own process, which SIGTERM ends.

Images: each role's image ships tandem's packages, filtered, and in the control, reward functions'
and rollout images ``[modal].modules`` and ``[modal].packages`` (the user's reward functions, tools
and tracker libraries); the app mounts nothing else (``include_source=False``). The control
plane refuses runs of another model than the rollout fleet's (``TANDEM_CONTROL_FLEET_MODEL``).
The weight broadcast goes over i6pn with ``[modal].i6pn``; without it the learner has no
broadcast host and a broadcast run publishes files.

Redis is not run inside the app: a container is reachable by others only over i6pn within one
region and must be discovered through a ``modal.Dict``, and it is restarted at the 24 h timeout
or on preemption (docs/modal.md). An external managed Redis (TLS, password) is the one
supported choice.

Configuration (read when this module is imported, locally and in each container):

- ``DEPLOY_RUN_CONFIG``: the run config (default ``examples/arith/run.toml``);
- ``DEPLOY_MODAL_TOML``: an optional TOML file whose ``[modal]`` table is
  ``deploy.config.ModalDeploy`` (GPUs, nodes, containers, timeouts; default: its defaults).

Neither name starts with ``TANDEM_``: ``tandem serve`` refuses unknown ``TANDEM_*`` names.
Deploying: docs/modal.md, step by step (``tandem deploy modal`` runs ``modal deploy -m deploy.modal_app``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from pathlib import Path, PurePosixPath

import modal

from deploy import launch
from deploy.config import (
    IMAGE_PACKAGES,
    REWARD_MODELS_DIR,
    SERVICE_ROLES,
    USER_ROLES,
    ModalDeploy,
    app_name,
    gpu_count,
    load_deploy,
    role_env,
    role_options,
    role_secret,
    role_volumes,
    tracker_packages,
)
from host.processes import free_port
from services.config import load_run_config
from services.weightstore import reload_volume

log = logging.getLogger("tandem.control")
REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("host", "services", "control_plane", "broker", "rollout_server", "reward_server", "learner", "deploy")
SOURCE_IGNORE = ["**/__pycache__/**", "**/*.pyc", "**/.*", "**/wheelhouse/**"]
"""What of the packages is not shipped. Everything else is, package data included: the SDK's default
ships ``.py`` files only, and the dashboard's ``control_plane/static`` would be missing (GET / 500)."""

if modal.is_local():
    RUN_CONFIG = Path(os.environ.get("DEPLOY_RUN_CONFIG", REPO_ROOT / "examples" / "arith" / "run.toml"))
    REMOTE_CONFIG = launch.container_path(RUN_CONFIG, REPO_ROOT)
    SECTION = load_deploy(os.environ.get("DEPLOY_MODAL_TOML"))
else:  # in a container: the image carries the resolved choices (see _image)
    REMOTE_CONFIG = PurePosixPath(os.environ["DEPLOY_RUN_CONFIG"])
    RUN_CONFIG = Path(REMOTE_CONFIG)
    SECTION = ModalDeploy.model_validate_json(os.environ["DEPLOY_MODAL_SECTION"])
    if os.environ["DEPLOY_ROLE"] in SERVICE_ROLES:  # the others have no service to pass SIGTERM on to
        launch.forward_signals()  # the container imports this module in its main thread

CONFIG = load_run_config(RUN_CONFIG)
APP_NAME = app_name(SECTION, CONFIG.name)

# include_source=False: the code ships once, filtered, in each image (_image); the SDK's default would also
# mount this module's whole package (deploy/, a filled wheelhouse/ included) on every deploy
app = modal.App(APP_NAME, include_source=False)
runs = modal.Volume.from_name(SECTION.volume, create_if_missing=True)


def image_packages(role: str) -> list[str]:
    """pip requirements of ``role``'s image: its extras' pins; the control plane's also the tracker libraries
    the run config names; the control, reward functions' and rollout images also ``[modal].packages``."""
    packages = list(IMAGE_PACKAGES[role])
    if role == "control":
        packages += tracker_packages(CONFIG.logging.trackers)
    return packages + (SECTION.packages if role in USER_ROLES else [])


def image_sources(role: str) -> tuple[str, ...]:
    """The Python packages ``role``'s image ships: tandem's, and ``[modal].modules`` in the control, reward
    functions' and rollout images (the reward functions and tools their settings name)."""
    return SOURCES + (tuple(SECTION.modules) if role in USER_ROLES else ())


def _models_image() -> modal.Image:
    """The reward models' image: the ``models`` role's, and each of ``[modal].reward_models``' folders at
    ``/reward-models/<name>``."""
    image = _image("models")
    for name, folder in SECTION.reward_models.items():
        image = image.add_local_dir(folder, f"{REWARD_MODELS_DIR}/{name}")
    return image


def _image(role: str) -> modal.Image:
    """``role``'s image: Python 3.11, its pip packages (:func:`image_packages`), then the code (with its
    package data, :func:`image_sources`) and the run config file alone (added last and not copied, so
    editing them rebuilds nothing; the config's folder is not shipped: at the repository root it would
    be ``runs/`` and ``.venv``)."""
    return (
        modal.Image.debian_slim(python_version="3.11")
        .uv_pip_install(*image_packages(role))
        .env({"DEPLOY_RUN_CONFIG": str(REMOTE_CONFIG), "DEPLOY_MODAL_SECTION": SECTION.model_dump_json(),
              "DEPLOY_ROLE": role})
        .add_local_python_source(*image_sources(role), ignore=SOURCE_IGNORE)
        .add_local_file(RUN_CONFIG, str(REMOTE_CONFIG))
    )


def _secrets(role: str) -> list[modal.Secret]:
    secret = role_secret(SECTION, role)
    if secret is None:
        return []
    name, keys = secret
    return [modal.Secret.from_name(name, required_keys=keys), modal.Secret.from_dict(role_env(SECTION, role))]


def _options(role: str) -> dict:
    """Everything ``@app.function`` / ``@app.cls`` gets for ``role``."""
    options = {**role_options(SECTION, role), "image": _image(role),
               "volumes": {path: runs for path in role_volumes(role)}, "secrets": _secrets(role)}
    if role == "learner":
        options["retries"] = modal.Retries(max_retries=SECTION.learner.retries, initial_delay=10.0)
    return options


def _settings(cls):
    """``cls`` from this container's environment, checked as ``tandem serve`` checks it."""
    from deploy.settings_reference import settings_classes
    from services.settings import check_environment

    check_environment(settings_classes().values())
    settings = cls()
    settings.check_auth_safe()
    return settings


@app.function(**_options("control"))
@modal.concurrent(max_inputs=SECTION.control.concurrency)
@modal.asgi_app(label=f"{APP_NAME}-control")
def control():
    """The control plane: REST API and dashboard; it spawns the learner of each run it accepts."""
    from control_plane import build_app
    from control_plane.settings import ControlSettings

    os.environ.setdefault("TANDEM_CONTROL_REWARD_URL", reward.get_web_url())  # python reward functions checked
    os.environ.setdefault("TANDEM_CONTROL_FLEET_MODEL", str(CONFIG.model.path))  # what Rollout.serve loads
    return build_app(_settings(ControlSettings), load_run_config(RUN_CONFIG), start_learner=_spawn_learner)


async def _spawn_learner(run_id: str) -> None:
    """``learner(run_id)`` as a Modal call of its own (the control plane's ``start_learner``)."""
    from control_plane.app import LearnerStartError

    try:
        call = await learner.spawn.aio(run_id)
    except modal.exception.Error as e:
        raise LearnerStartError(f"modal: {e}") from e
    log.info("run %s: learner call %s", run_id, call.object_id)


@app.function(**_options("reward"))
@modal.concurrent(max_inputs=SECTION.reward.concurrency)
@modal.asgi_app(label=f"{APP_NAME}-reward")
def reward():
    """The reward server; code runs in Modal Sandboxes (``TANDEM_REWARD_SANDBOX=modal``), python reward
    functions in ``RewardFunctions``."""
    from reward_server import build_app
    from reward_server.settings import RewardSettings

    return build_app(_settings(RewardSettings), load_run_config(RUN_CONFIG), functions_runner=_run_functions,
                     models_runner=_run_reward_model if SECTION.reward_models else None)


@app.cls(**_options("functions"))
@modal.concurrent(max_inputs=SECTION.functions.concurrency)
class RewardFunctions:
    """The python reward functions of the reward servers, a Restricted Function: what it runs reaches no
    Modal API, no Secret, no volume (and no network unless ``[modal].functions_network``)."""

    @modal.enter()
    def preload(self) -> None:
        from reward_server.verifiers.function_worker import preload

        preload(SECTION.modules)  # a slow import is not counted against a call's timeout

    @modal.method()
    def run(self, name: str, args: tuple) -> object:
        """``function_worker.<name>(*args)``: ``call`` (score) or ``resolve`` (look a function up)."""
        from reward_server.verifiers import function_worker

        if name not in ("call", "resolve"):
            raise ValueError(f"RewardFunctions.run: {name!r} is not call or resolve")
        return getattr(function_worker, name)(*args)


if SECTION.reward_models:

    @app.cls(**(_options("models") | {"image": _models_image()}))
    @modal.concurrent(max_inputs=SECTION.models.concurrency)
    class RewardModelWorker:
        """The reward models of ``[modal].reward_models``: loaded on the CPU into the container's memory snapshot
        (``enable_memory_snapshot``), so a new container starts with them in memory; moved to its GPU when it has
        one. A Restricted Function: no Modal API, no Secret, no volume, no network."""

        @modal.enter(snap=True)
        def load(self) -> None:
            from deploy.config import reward_model_paths
            from reward_server.verifiers.reward_models import _load

            for folder in reward_model_paths(SECTION).values():
                _load(folder, "cpu")

        @modal.enter(snap=False)
        def to_device(self) -> None:
            from reward_server.verifiers.reward_models import move_loaded

            if SECTION.models.gpu:
                move_loaded("cuda")

        @modal.method()
        def score(self, folder: str, pairs: list, batch_size: int, max_tokens: int) -> list:
            from reward_server.verifiers.reward_models import rewards

            return rewards(folder, "cuda" if SECTION.models.gpu else "cpu", batch_size, max_tokens, pairs)


async def _run_reward_model(folder: str, pairs: list, batch_size: int, max_tokens: int) -> list:
    """The reward server's ``models_runner``: ``RewardModelWorker.score`` as a call of its own, cancelled with
    its container when the server stops waiting (``model_timeout_s``)."""
    return await _remote(RewardModelWorker().score, folder, pairs, batch_size, max_tokens)


async def _remote(method, *args) -> object:
    """``method`` (a Modal method) called with ``args`` as a call of its own. Cancelled (the reward server's bound
    ran out, or its client went away), the call is cancelled and its container ended, so a call that hangs does
    not keep it; a call Modal lost is a :class:`~reward_server.verifiers.functions.WorkerLost`."""
    from reward_server.verifiers.functions import WorkerLost

    try:
        call = await method.spawn.aio(*args)
        try:
            return await call.get.aio()
        except asyncio.CancelledError:
            await asyncio.shield(call.cancel.aio(terminate_containers=True))
            raise
    except modal.exception.Error as e:
        raise WorkerLost(f"modal: {type(e).__name__}: {e}") from e


async def _run_functions(name: str, args: tuple) -> object:
    """The reward server's ``functions_runner``: ``RewardFunctions.run`` as a call of its own (:func:`_remote`),
    cancelled with its container when the server's ``function_timeout_s`` runs out."""
    return await _remote(RewardFunctions().run, name, args)


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
def learner(run_id: str):
    """The learner of one run: every rank of ``nodes`` × GPUs under torchrun (rank 0 publishes weights),
    until the run ends. Raises when it was interrupted (SIGTERM: timeout, preemption) while the run
    goes on, so Modal retries it; the retry resumes from the last checkpoint, after reloading the volume
    (a retry may run in a container reused from the last attempt, whose view of the volume lacks what
    the other nodes committed since). Cancelling the call ends torchrun (``launch.run``)."""
    nodes, rank, master, port = SECTION.learner.nodes, 0, None, None
    if nodes > 1:
        cluster = modal.Cluster.from_context()
        rank, master = cluster.container_rank(), cluster.container_ips()[0]
    else:
        port = free_port()  # one node: any free rendezvous port
    if os.environ.get("TANDEM_RUN_DIR_VOLUME"):
        reload_volume(os.environ["TANDEM_RUN_DIR_VOLUME"])
    launch.run(launch.torchrun_argv(nodes=nodes, node_rank=rank, master_addr=master, master_port=port,
                                    nproc_per_node=gpu_count(SECTION.learner.gpu)), _learner_env(run_id))


def _learner_env(run_id: str) -> dict[str, str]:
    """What only this attempt knows: its lease holder id, new in every attempt (an attempt Modal gave up on
    but that still runs must not renew the lease of the one that replaced it), and with ``[modal].i6pn``
    the address the rollout containers reach for a weight broadcast."""
    call = modal.current_function_call_id() or "local"
    env = {"TANDEM_LEARNER_ONE_RUN": run_id, "TANDEM_LEARNER_HOLDER": f"modal-call:{call}:{secrets.token_hex(4)}"}
    if SECTION.i6pn:
        env["TANDEM_LEARNER_BROADCAST_HOST"] = socket.getaddrinfo("i6pn.modal.local", None, socket.AF_INET6)[0][4][0]
    return env


async def _scale_rollout(*, min_containers: int, max_containers: int) -> None:
    """Set the rollout class's containers (``deploy.autoscale.tick``'s ``apply``), through the autoscaler
    API of its service function: ``Cls.update_autoscaler`` calls the deprecated
    ``Function.update_autoscaler`` (a warning every tick in modal 1.6.4)."""
    await Rollout._get_class_service_function().autoscaler.update.aio(min_containers=min_containers,
                                                                       max_containers=max_containers)


if SECTION.autoscale.enabled:

    @app.function(**_options("autoscale"), schedule=modal.Period(seconds=SECTION.autoscale.interval_s))
    def autoscale():
        """One look at the active run's backlog; sets ``Rollout``'s containers (``deploy.autoscale``)."""
        import asyncio

        from deploy.autoscale import tick
        from services.settings import CommonSettings

        async def look() -> None:
            from broker import connect

            redis = connect(CommonSettings().redis_url)
            try:
                await tick(redis, min_containers=SECTION.rollout.min_containers,
                           max_containers=SECTION.rollout.max_containers, policy=SECTION.autoscale,
                           apply=_scale_rollout)
            finally:
                await redis.aclose()

        asyncio.run(look())
