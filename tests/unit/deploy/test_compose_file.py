"""docker-compose.yml cannot rot: commands, ports and variables are checked against the code.

There is no Docker engine here, so the file is parsed and each service's
command is parsed by the real ``tandem`` CLI (typer/click), its port is
compared with its health check and with the URLs the other services use,
and every ``TANDEM_*`` variable must be read by the settings class of the
service it is given to. The security of the file is checked too: Redis requires a
password that no command line shows, and the reward container (untrusted code)
gets no runs volume and no Redis. The Redis config the file holds is fed to a real
``redis-server``.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis as redis_sync
import typer.main
import yaml

from deploy.cli import SERVICE_PACKAGES, ServiceName, settings_classes
from deploy.cli import app as cli_app
from services.settings import env_names

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: ``!reset`` (drop what the base file set) becomes RESET."""


RESET = object()
ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
CPU = yaml.load((ROOT / "docker-compose.cpu.yml").read_text(), Loader=ComposeLoader)
"""The CPU profile: an override file on top of docker-compose.yml."""
SERVICES = COMPOSE["services"]
TANDEM = {name: spec for name, spec in SERVICES.items() if spec.get("command", [])[:2] == ["tandem", "serve"]}
ONE_SHOT = {name: spec for name, spec in SERVICES.items() if name != "redis" and name not in TANDEM}
OTHER_VARIABLES = {"REDIS_URL"}
URL_VARIABLES = {"TANDEM_ROLLOUT_REWARD_URL": "reward", "TANDEM_CONTROL_REWARD_URL": "reward"}
UNTRUSTED = "reward"  # runs model-written code: no runs volume, no Redis
SECRETS = {"TANDEM_TOKEN": "compose-token-" + "t" * 32, "TANDEM_REWARD_TOKEN": "reward-token-" + "r" * 32,
           "REDIS_PASSWORD": "ab12" * 16}
"""What the operator's .env would hold, for interpolation."""


def interpolate(value: str, env: dict[str, str] = SECRETS) -> str:
    """Compose's variable interpolation: ``${V}``, ``${V:-default}``, ``${V:?error}``, ``$$``."""
    def one(match: re.Match) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name) or (name in env and op is None):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")  # compose refuses to start
        return arg if op == ":-" else ""

    out = re.sub(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:[-?])(?P<arg>[^}]*))?\}", one, value)
    return out.replace("$$", "$")


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
    assert set(SERVICES) == set(TANDEM) | set(ONE_SHOT) | {"redis"}
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
    """The settings container ``name`` would load from ``environment``, interpolated as compose does."""
    for variable, value in environment.items():
        monkeypatch.setenv(variable, interpolate(str(value)))
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
    expected = "TANDEM_REWARD_TOKEN" if name == UNTRUSTED else "TANDEM_TOKEN"
    assert "TANDEM_TOKEN" in environment and f"${{{expected}:?" in environment["TANDEM_TOKEN"]
    # and the values load as settings (a list must be JSON, a size an int, ...)
    settings = settings_from(name, environment, monkeypatch)
    if name == UNTRUSTED:
        return
    redis = urlparse(interpolate(environment["REDIS_URL"]))
    assert (redis.scheme, redis.hostname, redis.port) == ("redis", "redis", 6379)
    assert redis.password == SECRETS["REDIS_PASSWORD"]
    assert settings.redis_url == interpolate(environment["REDIS_URL"])
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
    if name in ("rollout", "control"):
        url = urlparse(settings.reward_url)
        assert (url.hostname, url.port) == ("reward", ports["reward"])


REWARD_CAPS = {"SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "KILL"}
"""What runsc needs in the reward container (docs/compose.md, "What each container may do")."""
REWARD_SECURITY_OPT = {"no-new-privileges:true", "seccomp=./deploy/reward-seccomp.json", "apparmor=unconfined"}
MUST_STAY_REFUSED = {"init_module", "finit_module", "kexec_load", "open_by_handle_at", "bpf", "keyctl", "userfaultfd",
                     "perf_event_open", "swapon", "reboot"}
"""Syscalls Docker's default profile refuses that the reward container's profile must refuse too."""


def test_the_reward_container_starts_gvisor_sandboxes_with_only_what_runsc_needs():
    """No `runtime: runsc` (nested gVisor is no thing, and bubblewrap cannot start in it): the default
    runtime, root in the container with all capabilities dropped but the five runsc needs, no
    privileged mode, a seccomp profile of Docker's refusals less pivot_root, and gVisor named as the
    sandbox, so that code is refused rather than run anywhere else."""
    spec = TANDEM[UNTRUSTED]
    assert "runtime" not in spec and "privileged" not in spec
    assert not {"devices", "pid", "ipc", "network_mode", "cgroup", "userns_mode", "volumes"} & set(spec)
    assert spec["user"] == "0:0" and spec["cap_drop"] == ["ALL"] and set(spec["cap_add"]) == REWARD_CAPS
    assert set(spec["security_opt"]) == REWARD_SECURITY_OPT
    environment = spec["environment"]
    assert environment["TANDEM_REWARD_SANDBOX"] == "gvisor"
    assert not any("UNSAFE" in k for k in environment) and "REDIS_URL" not in environment
    [profile_path] = [o.split("=", 1)[1] for o in spec["security_opt"] if o.startswith("seccomp=")]
    profile = json.loads((ROOT / profile_path).read_text())
    refused = {name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" for name in rule["names"]}
    assert MUST_STAY_REFUSED <= refused
    assert not {"pivot_root", "mount", "umount2", "unshare", "clone", "setns", "ptrace", "chroot"} & refused
    assert not any(rule["action"] == "SCMP_ACT_ALLOW" for rule in profile["syscalls"])  # a denylist on ALLOW
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"apt-get install [^\n]*\brunsc\b", dockerfile), "the image must carry runsc"


def test_gpu_services_reserve_a_gpu():
    for name in ("rollout", "learner"):
        devices = TANDEM[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_weights_volume_is_shared_by_learner_and_rollout():
    trusted = {name: spec for name, spec in TANDEM.items() if name != UNTRUSTED}
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in spec["volumes"]} for name, spec in trusted.items()}
    assert mounts["learner"]["/runs"] == mounts["rollout"]["/runs"] == mounts["control"]["/runs"] == "runs"
    assert "runs" in COMPOSE["volumes"]
    for name, spec in trusted.items():
        assert spec["environment"]["TANDEM_RUN_DIR"] == "/runs", name
        assert spec["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_reward_container_gets_no_runs_volume_and_no_redis():
    """It runs model-written code: with the runs volume it could rewrite checkpoints the learner
    unpickles, weights the rollout server serves; with REDIS_URL it could forge trajectories."""
    spec = TANDEM[UNTRUSTED]
    assert "volumes" not in spec and "depends_on" not in spec
    assert "REDIS_URL" not in spec["environment"] and "TANDEM_RUN_DIR" not in spec["environment"]
    assert not any("REDIS_PASSWORD" in str(v) for v in spec["environment"].values())


def test_the_reward_server_has_a_token_of_its_own(monkeypatch):
    """A sandbox escape in the reward container finds only a token that the reward server accepts:
    the full-scope TANDEM_TOKEN is not there, and no other service accepts the reward token."""
    reward = TANDEM[UNTRUSTED]["environment"]
    assert not any("${TANDEM_TOKEN" in str(v) for v in reward.values())
    assert interpolate(reward["TANDEM_TOKEN"]) == SECRETS["TANDEM_REWARD_TOKEN"]
    for name, spec in {**TANDEM, **ONE_SHOT}.items():
        if name == UNTRUSTED:
            continue
        accepted = {k: v for k, v in spec["environment"].items() if k in ("TANDEM_TOKEN", "TANDEM_TOKENS")}
        assert not any("TANDEM_REWARD_TOKEN" in str(v) for v in accepted.values()), name
    rollout = settings_from("rollout", TANDEM["rollout"]["environment"], monkeypatch)
    assert rollout.reward_bearer == SECRETS["TANDEM_REWARD_TOKEN"]  # what it sends to the reward server
    assert rollout.token.get_secret_value() == SECRETS["TANDEM_TOKEN"]  # what it accepts
    control = settings_from("control", TANDEM["control"]["environment"], monkeypatch)
    assert control.reward_token.get_secret_value() == SECRETS["TANDEM_REWARD_TOKEN"]  # it asks /v1/check
    assert control.token.get_secret_value() == SECRETS["TANDEM_TOKEN"]


def _redis_conf() -> str:
    [mount] = SERVICES["redis"]["configs"]
    return interpolate(COMPOSE["configs"][mount["source"]]["content"])


def test_redis_requires_a_password_that_no_command_line_shows():
    redis = SERVICES["redis"]
    command = " ".join(redis["command"])
    assert "requirepass" not in command and "REDIS_PASSWORD" not in command
    [mount] = redis["configs"]
    assert redis["command"][:2] == ["redis-server", mount["target"]]
    content = COMPOSE["configs"][mount["source"]]["content"]
    assert "requirepass ${REDIS_PASSWORD:?" in content
    for disabled in ("CONFIG", "DEBUG", "MODULE"):
        assert f'rename-command {disabled} ""' in content
    # the health check authenticates from the environment, not argv
    assert "${REDIS_PASSWORD:?" in redis["environment"]["REDISCLI_AUTH"]
    assert "REDIS_PASSWORD" not in " ".join(redis["healthcheck"]["test"])
    for name, spec in {**TANDEM, **ONE_SHOT}.items():
        if name != UNTRUSTED:
            assert "${REDIS_PASSWORD:?" in spec["environment"]["REDIS_URL"], name
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        interpolate(content, {})  # compose refuses to start without it


def _reply(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(command + b"\r\n")
        return s.recv(256)


def test_a_real_redis_server_enforces_the_compose_config(tmp_path):
    """The config and command line of the redis container, on Debian's redis-server 7."""
    from broker.embedded import server_version
    from host.processes import die_with_parent, free_port, stop_group

    binary = shutil.which("redis-server")
    if binary is None or server_version(binary) < (7, 0, 0):
        pytest.skip("needs redis-server 7 on PATH (the image is redis:7)")
    config = tmp_path / "tandem.conf"
    config.write_text(_redis_conf())
    port = free_port()
    args = [binary, str(config), *SERVICES["redis"]["command"][2:], "--port", str(port), "--dir", str(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    try:
        url = f"redis://:{SECRETS['REDIS_PASSWORD']}@127.0.0.1:{port}/0"
        client = redis_sync.Redis.from_url(url, retry=None)
        for _ in range(200):
            try:
                assert client.ping()
                break
            except redis_sync.ConnectionError:
                assert proc.poll() is None, "redis-server refused the compose config"
                time.sleep(0.05)
        assert _reply(port, b"PING").startswith(b"-NOAUTH")
        with pytest.raises(redis_sync.ResponseError, match="unknown command"):
            client.execute_command("CONFIG", "SET", "dir", str(tmp_path / "elsewhere"))
        assert client.info("persistence")["aof_enabled"] == 1  # the command line's flags still apply
        client.close()
    finally:
        stop_group(proc, grace_s=5)


def dockerignored(path: str) -> bool:
    """Whether the root .dockerignore keeps ``path`` out of the build context (its last matching
    pattern decides, as Docker's does; patterns here are names or ``**/`` globs)."""
    ignored = False
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").removeprefix("**/")
        parts = Path(path).parts
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) or fnmatch.fnmatch(part, pattern)
               for i, part in enumerate(parts, 1)):
            ignored = not keep
    return ignored


def test_dockerfile_copies_what_exists_and_the_context_holds():
    """Every COPY source exists and is in the build context (.dockerignore keeps .venv, runs/ and .env
    out, and lets in only what the Dockerfile copies)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copies = [line.split()[1:-1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        if sources[0].startswith("--from="):
            continue  # from an earlier stage
        for source in sources:
            assert list(ROOT.glob(source)), f"deploy/Dockerfile copies missing {source}"
            assert not dockerignored(source), f".dockerignore leaves {source} out of the build context"
    for secret in (".venv", "runs", ".env", ".git"):
        assert dockerignored(secret), secret
    assert "wheelhouse" in dockerfile and not dockerignored("deploy/wheelhouse/torch.whl")
    for name, spec in {**TANDEM, **ONE_SHOT}.items():
        assert spec["build"]["dockerfile"] == "deploy/Dockerfile", name


def merged(name: str) -> dict:
    """Service ``name`` as ``docker compose -f docker-compose.yml -f docker-compose.cpu.yml`` sees it
    (Compose merges mappings key by key; ``!reset`` removes the key)."""
    def merge(base, override):
        if not (isinstance(base, dict) and isinstance(override, dict)):
            return override
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value)
        return out

    return merge(SERVICES[name], CPU["services"].get(name, {}))


def test_the_cpu_profile_only_changes_what_a_cpu_host_needs():
    """One definition per service: the override names no new service and changes only images,
    the GPU reservations (reset) and the CPU thread settings; the reward server is the same but for its image."""
    assert set(CPU["services"]) <= set(SERVICES)
    for name, spec in CPU["services"].items():
        assert set(spec) <= {"image", "pull_policy", "environment", "deploy"}, name
        assert spec["pull_policy"] == "never", name  # local builds: Docker Hub need not be reachable
    for name in ("rollout", "learner"):
        assert CPU["services"][name]["deploy"] is RESET and "deploy" not in merged(name)
        assert "deploy" in SERVICES[name]  # the GPU default keeps its reservation
    assert merged("learner")["environment"]["DS_ACCELERATOR"] == "cpu"
    assert "VLLM_CPU_OMP_THREADS_BIND" in merged("rollout")["environment"]
    assert merged("reward") == SERVICES["reward"] | {"image": CPU["services"]["reward"]["image"], "pull_policy": "never"}
    assert "--appendonly" in merged("redis")["command"] and merged("redis")["configs"] == SERVICES["redis"]["configs"]


def test_the_cpu_profile_uses_the_images_that_make_image_builds():
    script = (ROOT / "deploy" / "image.sh").read_text()
    built = dict(re.findall(r"^(TANDEM_IMAGE|REDIS_IMAGE)=\$\{\1:-([^}]+)\}", script, re.M))
    assert interpolate(merged("redis")["image"], {}) == built["REDIS_IMAGE"]
    for name in {**TANDEM, **ONE_SHOT}:
        assert interpolate(merged(name)["image"], {}) == built["TANDEM_IMAGE"], name
    assert "EXTRAS=cpu,learner,reward,report" in script


@pytest.mark.parametrize("name", sorted({**TANDEM, **ONE_SHOT}))
def test_the_cpu_profile_variables_load_as_settings(name, monkeypatch):
    """What the override adds: TANDEM_* variables are settings of the service; the rest are the
    CPU backends' own (vLLM's thread binding, DeepSpeed's accelerator, OpenMP)."""
    environment = merged(name)["environment"]
    known = env_names(settings_class(name))
    for variable in CPU["services"].get(name, {}).get("environment", {}):
        assert variable in known or variable in {"VLLM_CPU_OMP_THREADS_BIND", "DS_ACCELERATOR", "OMP_NUM_THREADS"}
    settings_from(name, environment, monkeypatch)
