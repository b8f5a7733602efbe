"""deploy.modal_app, offline: the Modal graph builds, each function gets the options its deploy
section asks for, and each entrypoint runs only what ``tandem serve`` runs.

No Modal credentials exist here: the app is defined, never deployed. Options are read back from
the SDK's own ``Function.info()`` (``modal.types.FunctionInfo``); autoscaling options, which the SDK
keeps only in the request it sends when deploying, are read from ``SpyAppMock`` — a recording
wrapper around the real ``modal.App.function`` / ``modal.App.cls`` (a mock of Modal's cloud boundary:
it records the keyword arguments and passes them on unchanged).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import click
import modal
import pytest
import typer

from deploy import launch
from deploy.config import (
    CORE_PACKAGES,
    EXTRA_PACKAGES,
    IMAGE_PACKAGES,
    LABEL,
    ModalDeploy,
    RoleDeploy,
    app_name,
    describe,
    load_deploy,
    role_env,
    role_secret,
    role_volumes,
)

ROOT = Path(__file__).resolve().parents[3]
MODULE = ROOT / "deploy" / "modal_app.py"

CUSTOM = """
[modal]
app_name = "tandem-test"
volume = "runs-test"
secret = "tandem-test"
region = "us-east"
rollout_port = 9001

[modal.control]
cpu = 2.0
memory_mib = 3000
min_containers = 1
max_containers = 2
scaledown_window_s = 120
concurrency = 7
timeout_s = 3600

[modal.rollout]
gpu = "A100-80GB:2"
cpu = 6.0
memory_mib = 40000
min_containers = 3
max_containers = 5
scaledown_window_s = 900
concurrency = 11

[modal.reward]
cpu = 3.0
memory_mib = 5000
min_containers = 2
max_containers = 9
scaledown_window_s = 30
concurrency = 13

[modal.learner]
gpu = "H200:8"
nodes = 2
cpu = 48.0
memory_mib = 300000
timeout_s = 7200
retries = 4

[modal.autoscale]
interval_s = 45
"""


class SpyAppMock:
    """Mock of Modal's deploy boundary: records what ``app.function`` / ``app.cls`` are given."""

    def __init__(self, monkeypatch):
        self.calls: dict[int, dict] = {}  # id(Function or Cls) -> keyword arguments
        real_function, real_cls = modal.App.function, modal.App.cls
        spy = self

        def function(app, *args, **kw):
            wrap = real_function(app, *args, **kw)
            return lambda f: spy._record(f, kw, wrap)

        def cls(app, *args, **kw):
            wrap = real_cls(app, *args, **kw)
            return lambda c: spy._record(c, kw, wrap)

        monkeypatch.setattr(modal.App, "function", function)
        monkeypatch.setattr(modal.App, "cls", cls)

    def _record(self, target, kw, wrap):
        defined = wrap(target)
        self.calls[id(defined)] = kw
        return defined


def load_app(monkeypatch, tmp_path, deploy_toml: str | None):
    """deploy/modal_app.py imported afresh (a new module) with ``DEPLOY_MODAL_TOML`` set as given."""
    if deploy_toml is None:
        monkeypatch.delenv("DEPLOY_MODAL_TOML", raising=False)
    else:
        path = tmp_path / "modal.toml"
        path.write_text(deploy_toml)
        monkeypatch.setenv("DEPLOY_MODAL_TOML", str(path))
    monkeypatch.delenv("DEPLOY_RUN_CONFIG", raising=False)
    spy = SpyAppMock(monkeypatch)
    spec = importlib.util.spec_from_file_location(f"modal_app_under_test_{len(str(deploy_toml))}", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, spy


def info(module, role):
    if role == "rollout":
        return module.Rollout._get_class_service_function().info()
    return getattr(module, role).info()


def gpus(gpu: str | None) -> list[tuple[str, int]]:
    if gpu is None:
        return []
    kind, _, count = gpu.partition(":")
    return [(kind, int(count or 1))]


def test_importing_the_module_defines_the_whole_app_offline():
    import deploy.modal_app as m

    assert isinstance(m.app, modal.App) and m.app.name == "tandem-arith"
    for fn in (m.control, m.reward, m.learner, m.autoscale):
        assert isinstance(fn, modal.Function)
    assert isinstance(m.Rollout, modal.Cls)
    assert m.REMOTE_CONFIG == PurePosixPath("/examples/arith/run.toml")


@pytest.mark.parametrize("deploy_toml", [None, CUSTOM], ids=["defaults", "custom"])
def test_each_function_gets_the_options_of_its_deploy_section(monkeypatch, tmp_path, deploy_toml):
    module, spy = load_app(monkeypatch, tmp_path, deploy_toml)
    plan = ModalDeploy() if deploy_toml is None else ModalDeploy.model_validate(tomllib.loads(deploy_toml)["modal"])
    assert module.SECTION == plan
    assert module.app.name == (plan.app_name or "tandem-arith")
    recorded = {role: spy.calls[id(getattr(module, "Rollout" if role == "rollout" else role))]
                for role in ("control", "rollout", "reward", "learner")}
    for role in ("control", "rollout", "reward", "learner"):
        want: RoleDeploy = getattr(plan, role)
        got = info(module, role)
        assert got.gpus == gpus(want.gpu), role
        assert got.cpu == want.cpu, role
        assert got.memory_mib == want.memory_mib, role
        assert got.timeout == want.timeout_s, role
        assert got.regions == ([plan.region] if plan.region else None), role
        assert {p: v.name for p, v in got.volumes.items()} == {p: plan.volume for p in role_volumes(role)}, role
        assert got.secrets[0] == f"modal.Secret.from_name({role_secret(plan, role)[0]!r})", role
        assert got.secrets[1] == f"Secret.from_dict([{', '.join(role_env(plan, role))}])", role
        kw = recorded[role]
        if role == "learner":  # a call per run, retried, one cluster at a time
            assert got.concurrency_info is None
            assert (got.cluster_info.size if got.cluster_info else 1) == want.nodes
            assert got.max_retries == want.retries
            assert kw["max_containers"] == want.nodes and "min_containers" not in kw
        else:
            assert got.concurrency_info.max_inputs == want.concurrency, role
            assert got.cluster_info is None, role
            assert (kw["min_containers"], kw["max_containers"], kw["scaledown_window"]) == (
                want.min_containers, want.max_containers, want.scaledown_window_s), role
    assert info(module, "control").web_info is not None and info(module, "reward").web_info is not None
    assert set(info(module, "rollout").method_details) == {"serve"}
    assert role_env(plan, "rollout")["TANDEM_PORT"] == str(plan.rollout_port)
    assert role_env(plan, "reward")["TANDEM_REWARD_SANDBOX"] == "modal"
    # the learner commits the weights volume after a version, rollout servers reload it before one
    for role in ("rollout", "learner"):
        assert role_env(plan, role)["TANDEM_RUN_DIR_VOLUME"] == plan.volume, role
        assert "modal==1.6.4" in IMAGE_PACKAGES[role], role
    scaler = module.autoscale.info()
    assert scaler.schedule == f"Period(seconds={float(plan.autoscale.interval_s)})" and not scaler.volumes
    assert scaler.secrets[0] == f"modal.Secret.from_name({plan.secret!r})" and not scaler.gpus


def test_the_reward_server_gets_its_own_token_and_neither_redis_nor_the_run_volume(monkeypatch, tmp_path):
    """The reward container runs model-written code: like docker-compose's, it holds only its own token
    (a Secret of its own), no REDIS_URL and no writable /runs (whoever writes checkpoints runs code in
    the learner). Before: every role got the Secret `tandem` (master token, REDIS_URL) and the volume."""
    seen = []
    real = modal.Secret.from_name

    def from_name_recorder_mock(name, *a, required_keys=(), **kw):
        seen.append((name, list(required_keys)))
        return real(name, *a, required_keys=required_keys, **kw)

    monkeypatch.setattr(modal.Secret, "from_name", from_name_recorder_mock)
    module, _ = load_app(monkeypatch, tmp_path, None)
    shared = ("tandem", ["TANDEM_TOKEN", "REDIS_URL", "TANDEM_ROLLOUT_REWARD_TOKEN", "TANDEM_CONTROL_REWARD_TOKEN",
                         "TANDEM_OPENAI_TOKEN"])
    # in definition order: control, reward, rollout, learner, autoscale
    assert seen == [shared, ("tandem-reward", ["TANDEM_TOKEN"]), shared, shared, shared]
    reward = module.reward.info()
    assert reward.volumes == {}
    assert reward.secrets == ["modal.Secret.from_name('tandem-reward')",
                              "Secret.from_dict([TANDEM_REWARD_SANDBOX])"]
    assert not {"REDIS_URL", "TANDEM_RUN_DIR", "TANDEM_RUN_DIR_VOLUME"} & role_env(module.SECTION, "reward").keys()
    # its callers hold its token under their own names (settings of the rollout server and control plane)
    from deploy.cli import settings_classes
    from services.settings import env_names

    known = set().union(*(env_names(c) for c in settings_classes().values()))
    assert set(shared[1]) <= known


@pytest.mark.parametrize("network", [False, True])
def test_reward_functions_run_in_a_restricted_function_with_no_secret_volume_or_network(monkeypatch, tmp_path,
                                                                                        network):
    """The reward server keeps Modal's API (it creates the Sandboxes), so the python reward functions, which
    judge model-written completions, run in a Restricted Function of their own: no Modal API, no Secret, no
    volume, no network unless asked. Before: they ran in the reward server's container, whose Modal access
    lets code mount the runs volume or attach the Secret `tandem` to a new Sandbox."""
    module, spy = load_app(monkeypatch, tmp_path, f"[modal]\nfunctions_network = {str(network).lower()}\n"
                                                  "[modal.functions]\nmax_containers = 3\nconcurrency = 2\n")
    kw = spy.calls[id(module.RewardFunctions)]
    assert kw["restrict_modal_access"] is True and kw["block_network"] is (not network)
    assert kw["max_containers"] == 3 and kw["secrets"] == [] and kw["volumes"] == {}
    got = module.RewardFunctions._get_class_service_function().info()
    assert got.secrets == [] and got.volumes == {} and got.concurrency_info.max_inputs == 2
    for role in ("control", "reward", "rollout", "learner"):
        assert "restrict_modal_access" not in spy.calls[id(getattr(module, "Rollout" if role == "rollout" else role))]
    # the reward server hands its python functions to it
    reward = _functions(ast.parse(MODULE.read_text()))["reward"]
    passed = [k.value.id for n in ast.walk(reward) if isinstance(n, ast.Call) for k in n.keywords
              if k.arg == "functions_runner"]
    assert passed == ["_run_functions"]
    (line,) = [line for line in describe(module.SECTION, "arith") if "reward functions:" in line]
    assert "no Modal API, no secret, no volume" in line and ("no network" in line) is (not network)


def test_reward_models_run_in_a_restricted_container_that_starts_from_a_memory_snapshot(monkeypatch, tmp_path):
    """[modal] reward_models: the models ship in an image of their own, load on the CPU into the container's
    memory snapshot and move to the GPU [modal.models] asks for after a restore; the container reaches no
    Modal API, no Secret, no volume, no network; the reward server is told their paths and hands its
    reward-model calls to it. Without reward models there is no such container."""
    import json

    from modal._partial_function import _PartialFunctionFlags as Flags

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text("{}")
    added = []
    real = modal.Image.add_local_dir

    def add_local_dir_recorder_mock(self, local, remote, **kw):
        added.append((str(local), remote))
        return real(self, local, remote, **kw)

    monkeypatch.setattr(modal.Image, "add_local_dir", add_local_dir_recorder_mock)
    module, spy = load_app(monkeypatch, tmp_path, f'[modal]\nreward_models = {{ rm = "{rm}" }}\n'
                                                  '[modal.models]\ngpu = "L4"\n')
    kw = spy.calls[id(module.RewardModelWorker)]
    assert kw["enable_memory_snapshot"] is True and kw["restrict_modal_access"] is True and kw["block_network"] is True
    assert kw["gpu"] == "L4" and kw["secrets"] == [] and kw["volumes"] == {}
    assert added == [(str(rm), "/reward-models/rm")]
    user = module.RewardModelWorker._get_user_cls()
    flags = {name: _raw(vars(user)[name]).flags for name in ("load", "to_device")}
    assert flags == {"load": Flags.ENTER_PRE_SNAPSHOT, "to_device": Flags.ENTER_POST_SNAPSHOT}
    assert json.loads(role_env(module.SECTION, "reward")["TANDEM_REWARD_MODELS"]) == {"rm": "/reward-models/rm"}
    reward = _functions(ast.parse(MODULE.read_text()))["reward"]
    assert [k.arg for n in ast.walk(reward) if isinstance(n, ast.Call) for k in n.keywords
            if k.arg == "models_runner"] == ["models_runner"]
    plain, _ = load_app(monkeypatch, tmp_path, None)
    assert not hasattr(plain, "RewardModelWorker") and "TANDEM_REWARD_MODELS" not in role_env(plain.SECTION, "reward")
    with pytest.raises(ValueError, match="modal.reward_models"):
        ModalDeploy(reward_models={"../x": "/tmp"})


class _CallMock:
    """Mock of a Modal ``FunctionCall`` (Modal's cloud cannot be reached here): ``get`` waits until
    cancelled, or raises what it is given; ``cancel`` is recorded."""

    def __init__(self, raises: BaseException | None = None):
        self.raises, self.cancelled = raises, []
        self.get, self.cancel = SimpleNamespace(aio=self._get), SimpleNamespace(aio=self._cancel)

    async def _get(self):
        if self.raises is not None:
            raise self.raises
        await asyncio.Event().wait()

    async def _cancel(self, terminate_containers=False):
        self.cancelled.append(terminate_containers)


def test_a_reward_function_call_that_runs_out_of_time_is_cancelled_with_its_container(monkeypatch, tmp_path):
    """The reward server's timeout (function_timeout_s) cancels the remote call and ends its container, so a
    hung function does not keep it; a call Modal lost is a WorkerLost (a reward_error naming it), and the
    function's own exception comes back as it is."""
    from reward_server.verifiers.function_worker import FunctionError
    from reward_server.verifiers.functions import Functions, WorkerLost

    module, _ = load_app(monkeypatch, tmp_path, None)
    calls = []

    def cls_mock():  # RewardFunctions(): its run.spawn.aio starts the next prepared call
        async def spawn(name, args):
            return calls.pop(0)
        return SimpleNamespace(run=SimpleNamespace(spawn=SimpleNamespace(aio=spawn)))

    monkeypatch.setattr(module, "RewardFunctions", cls_mock)
    hung, lost, refused = _CallMock(), _CallMock(modal.exception.InternalFailure("worker gone")), _CallMock(
        FunctionError("m:f: cannot import m"))
    calls += [hung, lost, refused]
    functions = Functions(["m:*"], timeout_s=0.2, runner=module._run_functions)

    async def go():
        with pytest.raises(TimeoutError):
            await functions._run(asyncio.sleep, 0)
        with pytest.raises(WorkerLost, match="InternalFailure: worker gone"):
            await functions._run(asyncio.sleep, 0)
        return await functions.check(["m:f"])

    assert asyncio.run(go()) == {"m:f": "m:f: cannot import m"}
    assert hung.cancelled == [True] and lost.cancelled == [] and not calls


def test_the_openai_endpoint_has_a_key_of_its_own_with_the_infer_scope_only(monkeypatch):
    """The rollout containers' OpenAI-compatible endpoint takes TANDEM_OPENAI_TOKEN from the Secret
    `tandem`, a key that opens inference only (services.security). Before: its api_key was the master
    token, which also submits, stops and deletes runs and loads weights."""
    from rollout_server.settings import RolloutSettings
    from services.security import granted

    name, keys = role_secret(ModalDeploy(), "rollout")
    assert name == ModalDeploy().secret and "TANDEM_OPENAI_TOKEN" in keys
    master, key = "m" * 32, "k" * 32
    monkeypatch.setenv("TANDEM_TOKEN", master)  # what the container reads from the Secret
    monkeypatch.setenv("TANDEM_OPENAI_TOKEN", key)
    settings = RolloutSettings()
    assert settings.scoped_tokens() == {key: ["infer"]} and granted(["infer"]) == {"infer"}


def _mounted_files(spy_calls: list[tuple[str, tuple, dict]]) -> set[str]:
    """The container paths the image's local-file layers ship, built with Modal's own mount builder."""
    from modal.file_pattern_matcher import (
        NON_PYTHON_FILES,  # add_local_python_source's default: .py files only
        _ignore_fn,
    )
    from modal.mount import _Mount

    files = set()
    for method, args, kw in spy_calls:
        if method == "add_local_python_source":
            mount = _Mount._from_local_python_packages(*args, ignore=kw.get("ignore", NON_PYTHON_FILES))
        elif method == "add_local_dir":
            mount = _Mount._add_local_dir(Path(args[0]), PurePosixPath(args[1]), ignore=_ignore_fn(kw.get("ignore", [])))
        else:
            mount = _Mount._from_local_file(Path(args[0]), PurePosixPath(args[1]))
        files |= {str(remote) for entry in mount.entries for _local, remote in entry.get_files_to_upload()}
    return files


def test_the_image_ships_the_dashboard_files_and_the_run_config_alone(monkeypatch, tmp_path):
    """The mount of the code, as the SDK builds it, holds control_plane/static (GET / serves it; before,
    add_local_python_source's default shipped .py files only and the dashboard answered 500), and the
    run config ships as one file: before, its whole folder did (at the repository root: runs/ and .venv)."""
    calls = []
    for method in ("add_local_python_source", "add_local_dir", "add_local_file"):
        real = getattr(modal.Image, method)

        def add_local_recorder_mock(self, *args, _real=real, _method=method, **kw):
            calls.append((_method, args, kw))
            return _real(self, *args, **kw)

        monkeypatch.setattr(modal.Image, method, add_local_recorder_mock)
    module, _ = load_app(monkeypatch, tmp_path, None)
    files = _mounted_files(calls)
    from control_plane.dashboard import FILES

    assert {f"/root/control_plane/static/{name}" for name in FILES} | {"/root/control_plane/static/dashboard.html"} <= files
    shipped_configs = {f for f in files if not f.startswith("/root/")}
    assert shipped_configs == {"/examples/arith/run.toml"}
    assert not [f for f in files if "__pycache__" in f or "/wheelhouse/" in f or f.endswith(".pyc")]


def test_endpoint_labels_are_dns_labels():
    """The labels come from the app name, by default ``tandem-<run config name>``; a run name may hold
    capitals, '_' and '.', which a host name may not (before: deployed as given)."""
    from modal._utils.name_utils import is_valid_subdomain_label

    for name in ("tandem-arith", "tandem-qwen3-8b-base-lora", "Tandem", "tandem_x", "tandem.x", "tandem--x",
                 "tandem-", "9tandem", "t" * 41):
        ok = all(LABEL.match(f"{name}-{role}") for role in ("control", "reward", "rollout")) and len(name) <= 40
        assert ok == (is_valid_subdomain_label(f"{name}-control") and "--" not in f"{name}-control"
                      and len(name) <= 40 and name[0].isalpha()), name
        if not ok:
            with pytest.raises(ValueError, match="modal.app_name"):
                ModalDeploy(app_name=name)
    assert app_name(ModalDeploy(), "arith") == "tandem-arith"
    with pytest.raises(ValueError, match=r"modal.app_name \(unset: from the run config's name 'My_Run'\)"):
        app_name(ModalDeploy(), "My_Run")
    assert app_name(ModalDeploy(app_name="my-run"), "My_Run") == "my-run"


def test_the_deploy_section_is_checked_at_load_time(tmp_path):
    bad = {
        "[modal.learner]\ngpu = \"H100:4\"\nnodes = 2": "every GPU of each node",
        "[modal.rollout]\ngpu = \"H100:8\"\nnodes = 2": "only the learner",
        "[modal.reward]\nmin_containers = 3\nmax_containers = 2": "below min_containers",
        "[modal.control]\nscaledown_window_s = 1": "scaledown_window_s",
        "[modal.control]\nretries = 2": "only the learner",
        "[modal.rollout]\nmax_containers = 0": "max_containers",
        "[modal]\napp_name = \"My_App\"": "modal.app_name",
        "[modal.rollout]\ngpu = \"H100:x\"": "TYPE:COUNT",
        "[modal]\ngpus = 1": "gpus",
    }
    for text, message in bad.items():
        path = tmp_path / "bad.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_deploy(path)
    assert load_deploy(None) == ModalDeploy()


def test_image_pins_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert CORE_PACKAGES == project["dependencies"]
    for extra, packages in EXTRA_PACKAGES.items():
        assert packages == project["optional-dependencies"][extra], extra


# --- every entrypoint runs only what `tandem serve` runs -------------------------------------

ENTRYPOINTS = ["control", "reward", "Rollout.serve", "_rollout_env", "learner", "_learner_env", "_settings",
               "_spawn_learner", "_scale_rollout"]
SERVICE_MODULES = {"control_plane", "reward_server", "rollout_server", "learner"}
"""The packages whose ``build_app`` / ``serve`` ``tandem serve`` calls (deploy.cli.SERVICE_PACKAGES)."""
GLUE = {
    # the `tandem serve` command line (tests below parse it with the real CLI), run by the container
    "launch.serve_argv", "launch.torchrun_argv", "launch.start", "launch.run",
    # where the other containers are: this container's rank, rank 0's address, the reward URL
    "modal.Cluster.from_context", "cluster.container_rank", "cluster.container_ips",
    "reward.get_web_url", "os.environ.get", "os.environ.setdefault",
    # a learner call per run: its rendezvous port, the volume reloaded before it resumes, its lease holder's
    # id (the call's, and the attempt's), its address on i6pn for a weight broadcast
    "free_port", "reload_volume", "modal.current_function_call_id", "secrets.token_hex", "socket.getaddrinfo",
    # the autoscaler's apply: the rollout class's autoscaler (Function.autoscaler.update(...).aio)
    "Rollout._get_class_service_function", "aio",
    # the control plane's start_learner: Modal's spawn, its error as the control plane's, a log line
    "learner.spawn.aio", "LearnerStartError", "log.info",
}
"""Calls named in full (``uvicorn.run`` is not ``launch.run``)."""
HELPERS = {"_settings", "_rollout_env", "_learner_env", "cls", "gpu_count"}
"""This module's own helpers (themselves entrypoints above) and ``_settings``'s class argument."""


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out |= {f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)}
    return out


def _called(fn: ast.FunctionDef) -> set[str]:
    """Names of what ``fn``'s body calls (its decorators are Modal's options, not its behaviour)."""
    names = set()
    for node in (n for stmt in fn.body for n in ast.walk(stmt)):
        if isinstance(node, ast.Call):
            names.add(_dotted(node.func))
    return names


def _dotted(f: ast.expr) -> str:
    """``a.b.c`` for a call of a plain name chain; else the called attribute's name."""
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        return ".".join([f.id, *reversed(parts)])
    return parts[0] if parts else "<expr>"


def _allowed(name: str, serve_path: set[str]) -> bool:
    """``name`` is glue named in full, or its last part is a name the serve path calls."""
    return name in GLUE or name.rsplit(".", 1)[-1] in serve_path


def _cli_serve_path() -> set[str]:
    """Names ``tandem serve`` calls (last parts): deploy/cli.py's ``serve`` and deploy/client.py's ``load_settings``."""
    cli = _functions(ast.parse((ROOT / "deploy" / "cli.py").read_text()))
    client = _functions(ast.parse((ROOT / "deploy" / "client.py").read_text()))
    return {n.rsplit(".", 1)[-1] for n in _called(cli["serve"]) | _called(client["load_settings"])}


def test_entrypoints_call_only_what_tandem_serve_calls():
    from deploy.cli import SERVICE_PACKAGES, settings_classes

    assert set(SERVICE_PACKAGES.values()) <= SERVICE_MODULES
    serve_path = (_cli_serve_path() | {"build_app"} | {c.__name__ for c in settings_classes().values()}
                  | HELPERS)
    assert {"check_environment", "settings_classes", "check_auth_safe", "load_run_config"} <= serve_path
    functions = _functions(ast.parse(MODULE.read_text()))
    for name in ENTRYPOINTS:
        called = {n for n in _called(functions[name]) if not _allowed(n, serve_path)}
        assert not called, f"{name} calls {sorted(called)}, which `tandem serve` does not"
        for node in ast.walk(functions[name]):
            assert not isinstance(node, ast.Import), f"{name}: import only service entries (from X import Y)"
            if isinstance(node, ast.ImportFrom):
                assert node.module in SERVICE_MODULES | {"services.settings", "deploy.settings_reference", "reward_server.settings", "control_plane.settings",
                                                         "control_plane.app"}, (name, node.module)
                if node.module in SERVICE_MODULES:
                    assert [a.name for a in node.names] == ["build_app"], (name, node.module)
                if node.module == "control_plane.app":
                    assert [a.name for a in node.names] == ["LearnerStartError"], (name, node.module)


def test_the_allow_list_refuses_a_call_outside_the_serve_path():
    serve_path = _cli_serve_path() | {"build_app", "ControlSettings"} | HELPERS
    own_server = ast.parse("def control():\n    return uvicorn.run(build_app(ControlSettings()))\n")
    assert [n for n in _called(own_server.body[0]) if not _allowed(n, serve_path)] == ["uvicorn.run"]
    own_loop = ast.parse("def learner():\n    Trainer(settings, config).run_blocking()\n")
    assert {n for n in _called(own_loop.body[0]) if not _allowed(n, serve_path)} == {"Trainer", "run_blocking"}


def _serve_context(argv: list[str]) -> click.Context:
    """Parse ``argv`` (after ``-m deploy.cli``) with the real CLI, without running it."""
    from deploy.cli import app as cli

    group = typer.main.get_command(cli)
    assert argv[0] == "serve"
    return group.commands["serve"].make_context("serve", argv[1:])


def test_rollout_runs_the_tandem_serve_command_line():
    argv = launch.serve_argv("rollout", PurePosixPath("/examples/arith/run.toml"))
    assert argv[:3] == [sys.executable, "-m", "deploy.cli"]
    params = _serve_context(argv[3:]).params
    assert params["name"].value == "rollout" and params["config"] == Path("/examples/arith/run.toml")


def test_learner_runs_torchrun_over_the_tandem_serve_command_line():
    from torch.distributed.run import get_args_parser

    for nodes, rank, master in ((1, 0, None), (2, 1, "fd00::1")):
        argv = launch.torchrun_argv(nodes=nodes, node_rank=rank, master_addr=master, nproc_per_node=8,
                                    config="/examples/arith/run.toml")
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        args = get_args_parser().parse_args(argv[3:])
        assert (args.nnodes, args.nproc_per_node, args.node_rank) == (str(nodes), "8", rank)
        assert args.master_addr == (master or "127.0.0.1")
        assert args.module and args.training_script == "deploy.cli"
        params = _serve_context(args.training_script_args).params
        assert params["name"].value == "learner" and params["config"] == Path("/examples/arith/run.toml")
    with pytest.raises(ValueError, match="rank 0"):
        launch.torchrun_argv(nodes=2, node_rank=1, master_addr=None, nproc_per_node=8, config="x")


def test_the_run_config_lands_where_its_runs_paths_reach_the_volume():
    import deploy.modal_app as m

    remote_model = os.path.normpath(m.REMOTE_CONFIG.parent / os.path.relpath(m.CONFIG.model.path, m.RUN_CONFIG.parent))
    assert remote_model == "/runs/models/arith"
    with pytest.raises(ValueError, match="inside the repository"):
        launch.container_path(Path("/tmp/elsewhere/run.toml"), ROOT)


def test_a_service_that_exits_ends_its_container_with_its_status():
    code = "import sys, time; from deploy.launch import start; start([sys.executable, '-c', 'raise SystemExit(3)']); time.sleep(60)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    with pytest.raises(RuntimeError, match="exited with 4"):
        launch.run([sys.executable, "-c", "raise SystemExit(4)"])
    launch.run([sys.executable, "-c", "pass"])


def test_tandem_deploy_modal_runs_modal_deploy_on_the_app_with_the_run_config(tmp_path):
    """`tandem deploy modal --dry-run` names `modal deploy -m deploy.modal_app` and the environment that
    picks the run config; that environment builds the app (offline) for that config."""
    import os
    import shlex
    import subprocess
    import sys

    from typer.testing import CliRunner

    from deploy.cli import app as cli

    config = ROOT / "examples/arith/run.toml"  # the app ships the config's folder: it lives in the repository
    out = CliRunner().invoke(cli, ["deploy", "modal", "--config", str(config), "--dry-run"])
    assert out.exit_code == 0, out.output
    plan = out.output.strip().splitlines()[:-1]  # the plan, role by role, then the command
    from deploy.config import describe

    assert plan == describe(ModalDeploy(), "arith")
    for role in ("control:", "reward:", "rollout:", "learner:", "secret tandem ", "secret tandem-reward "):
        assert any(line.strip().startswith(role) for line in plan), (role, plan)
    words = shlex.split(out.output.strip().splitlines()[-1])
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    assert env == {"DEPLOY_RUN_CONFIG": str(config)}
    assert words[len(env):][1:] == ["-m", "modal", "deploy", "-m", "deploy.modal_app"]
    built = subprocess.run([sys.executable, "-c", "import deploy.modal_app as m; print(m.app.name)"],
                           env={**os.environ, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.split()[-1] == "tandem-arith"
    bad = CliRunner().invoke(cli, ["deploy", "gcp", "--config", str(config), "--dry-run"])
    assert bad.exit_code == 2 and "unknown deploy target" in bad.output


# --- issue 35: what each image gets, signals, the learner's attempts, the autoscaler, the broadcast -------

CONTAINER = """
import os, signal, sys, time
import modal
modal.is_local = lambda: False  # as in a container: the module reads its choices from the image's environment
import deploy.modal_app  # noqa: F401
os.kill(os.getpid(), signal.SIGTERM)  # Modal's stop (scale-down, preemption, timeout)
time.sleep(10)
print("SIGTERM ignored", flush=True)
"""


@pytest.mark.parametrize(("role", "forwards"), [("control", False), ("reward", False), ("autoscale", False),
                                                ("rollout", True), ("learner", True)])
def test_only_containers_that_run_services_pass_sigterm_on(role, forwards):
    """A container importing the app installs the SIGTERM forwarder only where a service process runs
    (rollout, learner); the others serve in their own process, which SIGTERM must end. Before: every
    container ignored SIGTERM until Modal killed it after the grace period."""
    env = {**os.environ, "DEPLOY_ROLE": role, "DEPLOY_RUN_CONFIG": str(ROOT / "examples/arith/run.toml"),
           "DEPLOY_MODAL_SECTION": ModalDeploy().model_dump_json(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CONTAINER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    if forwards:
        assert done.returncode == 0 and "SIGTERM ignored" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == -15, (done.returncode, done.stdout, done.stderr[-2000:])


def _raw(obj):
    from modal._utils.async_utils import synchronizer

    return synchronizer._translate_in(obj)


def test_no_function_mounts_source_beside_its_image():
    """include_source=False: the code reaches the containers only through each image's filtered
    add_local_python_source. Before: the SDK also mounted the app module's whole package (deploy/, a
    filled deploy/wheelhouse/ too) with its default filter, on every deploy. The app is imported as
    ``modal deploy -m deploy.modal_app`` imports it: as a module of its package."""
    import deploy.modal_app as module

    functions = {name: getattr(module, name) for name in ("control", "reward", "learner", "autoscale")}
    functions["rollout"] = module.Rollout._get_class_service_function()
    for name, fn in functions.items():
        local = [m for m in _raw(fn)._spec.mounts if m.is_local()]  # the other: Modal's own client, from Modal
        assert local == [], (name, [str(r) for m in local for e in m.entries for _, r in e.get_files_to_upload()][:5])


def test_your_modules_and_packages_reach_the_control_functions_and_rollout_images(monkeypatch, tmp_path):
    """[modal] modules and packages: the reward functions, tools and tracker libraries a deployment uses
    are shipped to the control, reward functions' and rollout images, not the reward server's (the SDK's
    own record of each image's Python sources; its pip layers as given); the tracker libraries the run
    config names reach the control image without being listed. Before: only tandem's packages were
    shipped, and a run with trackers got 422 from the deployed control plane."""
    (tmp_path / "my_rewards").mkdir()
    (tmp_path / "my_rewards" / "__init__.py").write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pip = []
    real = modal.Image.uv_pip_install

    def uv_pip_install_recorder_mock(self, *packages, **kw):
        pip.append(list(packages))
        return real(self, *packages, **kw)

    monkeypatch.setattr(modal.Image, "uv_pip_install", uv_pip_install_recorder_mock)
    module, _ = load_app(monkeypatch, tmp_path, '[modal]\nmodules = ["my_rewards"]\npackages = ["sympy==1.14.0"]\n')
    images = {"control": module.control, "reward": module.reward, "learner": module.learner,
              "autoscale": module.autoscale, "rollout": module.Rollout._get_class_service_function(),
              "functions": module.RewardFunctions._get_class_service_function()}
    for role, fn in images.items():
        shipped = _raw(fn)._spec.image._added_python_source_set
        assert ("my_rewards" in shipped) == (role in ("control", "functions", "rollout")), role
        assert {"deploy", "reward_server", "rollout_server"} <= shipped, role
    # in definition order: control, reward, functions, rollout, learner, autoscale
    assert [("sympy==1.14.0" in p) for p in pip] == [True, False, True, True, False, False]
    from modal.mount import _Mount

    mount = _Mount._from_local_python_packages("my_rewards", ignore=module.SOURCE_IGNORE)
    assert {str(r) for e in mount.entries for _, r in e.get_files_to_upload()} == {"/root/my_rewards/__init__.py"}
    from deploy.config import tracker_packages

    assert tracker_packages(["wandb", "mlflow"]) == ["wandb>=0.31", "mlflow>=3.17"]
    assert [p for p in module.image_packages("control") if "tensorboard" in p] == []  # arith names no tracker
    monkeypatch.setattr(module, "CONFIG", module.CONFIG.model_copy(update={"logging": module.CONFIG.logging.model_copy(
        update={"trackers": ["tensorboard"]})}))
    assert "tensorboard>=2.21" in module.image_packages("control")
    assert "tensorboard>=2.21" not in module.image_packages("reward")
    with pytest.raises(ValueError, match="modal.modules"):
        ModalDeploy(modules=["my-rewards"])


def test_each_learner_attempt_has_its_own_lease_holder(monkeypatch, tmp_path):
    """Modal retries a call under the same call id; an attempt it gave up on (cancelled, timed out) may still
    run, and must not renew the lease of the attempt that replaced it. Before: the holder was the call id."""
    module, _ = load_app(monkeypatch, tmp_path, None)
    monkeypatch.setattr(modal, "current_function_call_id", lambda: "fc-01")
    first, second = (module._learner_env("r1")["TANDEM_LEARNER_HOLDER"] for _ in range(2))
    assert first.startswith("modal-call:fc-01:") and second.startswith("modal-call:fc-01:") and first != second


class VolumeReloaded(Exception):
    pass


@pytest.mark.filterwarnings("ignore:The learner function is executing locally")
def test_the_learner_reloads_the_volume_before_it_starts(monkeypatch, tmp_path):
    """A retry may run in the container of the failed attempt, whose view of the volume lacks what the other
    nodes committed since: the learner function reloads the volume before it starts torchrun. The
    volume is a mock of Modal's cloud (it raises on reload, so nothing is started)."""
    module, _ = load_app(monkeypatch, tmp_path, None)
    reloaded = []

    class VolumeMock:
        def __init__(self, name):
            self.name = name

        def reload(self):
            reloaded.append((self.name, list(launch._services)))
            raise VolumeReloaded

    monkeypatch.setattr(modal.Volume, "from_name", lambda name, **kw: VolumeMock(name))
    monkeypatch.setenv("TANDEM_RUN_DIR_VOLUME", "tandem-runs")
    started = list(launch._services)
    with pytest.raises(VolumeReloaded):
        module.learner.local("r1")
    assert reloaded == [("tandem-runs", started)]  # before torchrun was started


def test_the_autoscaler_uses_the_function_autoscaler_api(monkeypatch, tmp_path):
    """The autoscaler sets the rollout class's containers through ``Function.autoscaler.update``: the
    class's ``update_autoscaler`` calls ``Function.update_autoscaler``, deprecated in modal 1.6.4 (a
    warning every tick). Modal's cloud is a spy at the SDK's gRPC stub (it records the request)."""
    import asyncio
    import warnings

    from modal._functions import _Function
    from modal_proto import api_pb2

    requests = []

    class StubSpy:
        async def FunctionUpdateSchedulingParams(self, request):
            requests.append(request)
            return api_pb2.FunctionUpdateSchedulingParamsResponse()

    async def hydrate_spy(self, client=None):
        self._client = type("ClientSpy", (), {"_stub": StubSpy()})()
        self._object_id = "fu-spy"
        self._is_hydrated = True
        return self

    monkeypatch.setattr(_Function, "hydrate", hydrate_spy)
    module, _ = load_app(monkeypatch, tmp_path, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(module._scale_rollout(min_containers=2, max_containers=4))
    assert [(r.settings.min_containers, r.settings.max_containers) for r in requests] == [(2, 4)]


def test_the_weight_broadcast_runs_over_i6pn_or_not_at_all(monkeypatch, tmp_path):
    """Without [modal] i6pn the rollout containers cannot reach the learner: its broadcast host is empty, so
    a broadcast run publishes files at once (before: 127.0.0.1, and each version waited out
    broadcast_timeout_s). With it, the learner and the rollout servers get i6pn, in one region."""
    plan = ModalDeploy()
    assert role_env(plan, "learner")["TANDEM_LEARNER_BROADCAST_HOST"] == ""
    with pytest.raises(ValueError, match="modal.region"):
        ModalDeploy(i6pn=True)
    module, spy = load_app(monkeypatch, tmp_path, '[modal]\ni6pn = true\nregion = "us-east"\n')
    assert "TANDEM_LEARNER_BROADCAST_HOST" not in role_env(module.SECTION, "learner")  # its i6pn address, at call time
    assert spy.calls[id(module.learner)]["i6pn"] and spy.calls[id(module.Rollout)]["i6pn"]
    assert "i6pn" not in spy.calls[id(module.control)] and "i6pn" not in spy.calls[id(module.reward)]
