"""docker-compose.yml cannot rot: commands, ports and variables are checked against the code.

There is no Docker engine here, so the file is parsed and each service's
command is parsed by the real ``tandem`` CLI (typer/click), its port is
compared with its health check and with the URLs the other services use,
and every ``TANDEM_*`` variable must be read by the settings class of the
service it is given to.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import typer.main
import yaml

from services.cli import SERVICE_PACKAGES, ServiceName, settings_classes
from services.cli import app as cli_app
from services.settings import env_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
TANDEM = {name: spec for name, spec in SERVICES.items() if spec.get("command", [])[:2] == ["tandem", "serve"]}
ONE_SHOT = {name: spec for name, spec in SERVICES.items() if name != "redis" and name not in TANDEM}
OTHER_VARIABLES = {"REDIS_URL"}
URL_VARIABLES = {"TANDEM_ROLLOUT_REWARD_URL": "reward"}


def settings_class(name: str):
    """The settings class of compose service ``name`` (the bootstrap is a CLI command: the stack's)."""
    return settings_classes()["stack" if name in ONE_SHOT else name]


def parse_command(command: list[str]):
    """Parse ``tandem ...`` exactly as the CLI would, without running it (a click context)."""
    assert command[0] == "tandem", command
    group = typer.main.get_command(cli_app)
    sub = group.commands.get(command[1])
    assert sub is not None, f"no CLI command {command[1]!r}"
    return sub.make_context(f"tandem {command[1]}", list(command[2:]))


def command_of(spec: dict) -> list[str]:
    command = spec["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def health_port(spec: dict) -> int:
    test = " ".join(spec["healthcheck"]["test"])
    match = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)/healthz", test)
    assert match, f"health check does not GET /healthz: {test}"
    return int(match.group(1))


def exposed_ports(spec: dict) -> set[int]:
    ports = {int(str(p).split(":")[-1].split("/")[0]) for p in spec.get("ports", [])}
    return ports | {int(str(p).split("/")[0]) for p in spec.get("expose", [])}


def test_every_service_of_the_architecture_is_there():
    assert set(TANDEM) == {s.value for s in ServiceName} == {s.value for s in SERVICE_PACKAGES}
    assert SERVICES["redis"]["image"].startswith("redis:7")
    assert "--appendonly" in SERVICES["redis"]["command"]
    assert SERVICES["redis"]["command"][SERVICES["redis"]["command"].index("--appendonly") + 1] == "yes"


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_command_parses_with_the_cli(name):
    ctx = parse_command(command_of(TANDEM[name]))
    assert ctx.info_name == "tandem serve"
    assert ctx.params["name"] == ServiceName(name)
    assert ctx.params["host"] == "0.0.0.0"
    assert ctx.params["port"] is not None
    if name != "reward":
        assert str(ctx.params["config"]) == "/config/run.toml"


def test_the_model_is_bootstrapped_where_the_run_config_expects_it():
    """The example config's relative model path, resolved from /config, lands in the shared volume."""
    from services.config import load_run_config

    assert set(ONE_SHOT) == {"bootstrap"}
    spec = ONE_SHOT["bootstrap"]
    ctx = parse_command(command_of(spec))
    config = load_run_config(ROOT / "examples" / "arith" / "run.toml")
    relative = config.model.path.relative_to(ROOT / "runs")
    assert ctx.params["out"].as_posix() == f"/runs/{relative.as_posix()}"
    assert ctx.params["data"].as_posix() == "/config/train.jsonl" and (ROOT / "examples/arith/train.jsonl").exists()
    for name in ("rollout", "learner"):
        assert TANDEM[name]["depends_on"]["bootstrap"]["condition"] == "service_completed_successfully"
    assert spec["restart"] == "no"


def test_a_wrong_command_would_be_caught():
    # typer vendors its own click: match its usage errors by message
    with pytest.raises(Exception, match="No such option: --prot"):
        parse_command(["tandem", "serve", "control", "--prot", "8000"])
    with pytest.raises(Exception, match="'controller' is not one of"):
        parse_command(["tandem", "serve", "controller"])
    with pytest.raises(AssertionError, match="no CLI command"):
        parse_command(["tandem", "srve", "control"])


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_port_matches_health_check_and_exposure(name):
    spec = TANDEM[name]
    port = parse_command(command_of(spec)).params["port"]
    assert health_port(spec) == port
    assert port in exposed_ports(spec)
    assert spec["healthcheck"]["retries"] >= 1


def settings_from(name: str, environment: dict, monkeypatch):
    """The settings container ``name`` would load from ``environment`` (compose interpolation left out)."""
    for variable, value in environment.items():
        monkeypatch.setenv(variable, "compose-token" if variable == "TANDEM_TOKEN" else str(value))
    return settings_class(name)()


@pytest.mark.parametrize("name", sorted({**TANDEM, **ONE_SHOT}))
def test_every_variable_is_a_setting(name, monkeypatch):
    environment = {**TANDEM, **ONE_SHOT}[name]["environment"]
    known = env_names(settings_class(name))
    for variable in environment:
        if variable.startswith("TANDEM_"):
            assert variable in known, f"{name}: {variable} is not read by {settings_class(name).__name__}"
        else:
            assert variable in OTHER_VARIABLES, f"{name}: unexpected variable {variable}"
    assert "TANDEM_TOKEN" in environment and "${TANDEM_TOKEN:?" in environment["TANDEM_TOKEN"]
    redis = urlparse(environment["REDIS_URL"])
    assert (redis.hostname, redis.port) == ("redis", 6379)
    # and the values load as settings (a list must be JSON, a size an int, ...)
    settings = settings_from(name, environment, monkeypatch)
    assert settings.redis_url == environment["REDIS_URL"]
    assert str(settings.run_dir) == environment["TANDEM_RUN_DIR"]


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_service_urls_point_at_the_right_container_and_port(name, monkeypatch):
    environment = TANDEM[name]["environment"]
    settings = settings_from(name, environment, monkeypatch)
    ports = {n: parse_command(command_of(s)).params["port"] for n, s in TANDEM.items()}
    for variable, target in URL_VARIABLES.items():
        if variable in environment:
            url = urlparse(environment[variable])
            assert (url.hostname, url.port) == (target, ports[target]), variable
    if name == "rollout":
        url = urlparse(settings.reward_url)
        assert (url.hostname, url.port) == ("reward", ports["reward"])


def test_reward_runs_under_gvisor_and_gpu_services_reserve_a_gpu():
    assert TANDEM["reward"]["runtime"] == "runsc"
    for name in ("rollout", "learner"):
        devices = TANDEM[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_weights_volume_is_shared_by_learner_and_rollout():
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in spec["volumes"]} for name, spec in TANDEM.items()}
    assert mounts["learner"]["/runs"] == mounts["rollout"]["/runs"] == "runs"
    assert "runs" in COMPOSE["volumes"]
    for name, spec in TANDEM.items():
        assert spec["environment"]["TANDEM_RUN_DIR"] == "/runs", name
        assert spec["depends_on"]["redis"]["condition"] == "service_healthy"


def test_dockerfile_copies_what_exists():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"deploy/Dockerfile copies missing {source}"
    for name, spec in {**TANDEM, **ONE_SHOT}.items():
        assert spec["build"]["dockerfile"] == "deploy/Dockerfile", name
