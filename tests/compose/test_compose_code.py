"""Code rewards under `docker compose`: the reward container runs each program in a gVisor sandbox of its own.

The reward service of docker-compose.yml + docker-compose.cpu.yml alone (it depends on nothing),
under a project name of its own, published on a free loopback port by an override file this test
writes (the compose file publishes only the control plane). Against it run the same tests as
against a reward server on the host, imported rather than copied: ``python_tests`` scoring
(tests/integration/reward_server/test_score.py: a correct program scores 1, a wrong or broken one
0) and the hostile programs (tests/integration/reward_server/test_hostile.py). ``GET /v1/sandbox``
must name gVisor, with ``TANDEM_REWARD_UNSAFE_LOCAL`` unset and the container unprivileged.

Left out of the hostile set: the leftover-process check, which needs a one-worker server and
reads the host's process table (gVisor's guests are no host processes either way).
Marked ``compose`` (``make compose-test``; not in ``make test``).
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from pathlib import Path

import httpx
import pytest

from host.processes import free_port
from tests.compose.conftest import sh
from tests.fixtures.reward import RewardServer, Secret
from tests.integration.reward_server.test_hostile import (  # noqa: F401  (collected here, against compose)
    test_100mb_of_stdout,
    test_deleting_files_outside_tmp,
    test_fork_bomb,
    test_huge_file,
    test_infinite_loop,
    test_killing_its_parent,
    test_memory_bomb,
    test_network_is_unreachable,
    test_one_hostile_program_does_not_stall_the_others,
    test_secrets_stay_out,
    test_sleep_past_the_limit,
)
from tests.integration.reward_server.test_score import test_python_tests  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.compose, pytest.mark.timeout(1800)]

PLANTED = "/tmp/planted-secret.txt"
"""A world-readable file in the reward container that no sandboxed program may read."""


class ComposeRewardServer(RewardServer):
    """The compose reward server, seen as the host tests see theirs: its own token in the header."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__("gvisor", url, pid=0)
        self.token = token

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def compose_reward(images, tmp_path_factory):
    project = f"tandem-code-{uuid.uuid4().hex[:8]}"
    port, token = free_port(), secrets.token_hex(32)
    override = tmp_path_factory.mktemp("compose") / "publish-reward.yml"
    override.write_text(f'services:\n  reward:\n    ports: ["127.0.0.1:{port}:8002"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_")) and k != "REDIS_URL"}
    env.update(COMPOSE_PROJECT_NAME=project, COMPOSE_FILE=f"docker-compose.yml:docker-compose.cpu.yml:{override}",
               TANDEM_TOKEN=secrets.token_hex(32), TANDEM_REWARD_TOKEN=token, REDIS_PASSWORD=secrets.token_hex(32))
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        sh("docker", "compose", "up", "-d", "reward", env=env, timeout=600)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=3).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, sh("docker", "compose", "logs", "reward", env=env).stdout[-3000:]
            time.sleep(1)
        print(f"compose reward server healthy {time.monotonic() - started:.1f} s after up")
        sh("docker", "compose", "exec", "-T", "reward", "sh", "-c", f"umask 022 && printf %s {token} > {PLANTED}",
           env=env)
        yield env, ComposeRewardServer(url, token)
    finally:
        logs = sh("docker", "compose", "logs", "--no-color", "reward", env=env, check=False)
        (tmp_path_factory.getbasetemp() / f"{project}.log").write_text(logs.stdout + logs.stderr)
        sh("docker", "compose", "down", "-v", "--remove-orphans", env=env, timeout=300)


@pytest.fixture
def reward_server(compose_reward) -> RewardServer:
    return compose_reward[1]


@pytest.fixture
def gvisor_server(compose_reward) -> RewardServer:
    return compose_reward[1]


@pytest.fixture
def reward_secret(compose_reward) -> Secret:
    """The secret a program would want most: the reward container's token, in its environment
    (TANDEM_TOKEN) and planted in a world-readable file beside the server."""
    return Secret(value=compose_reward[1].token, path=Path(PLANTED), env_name="TANDEM_TOKEN")


def test_the_reward_container_runs_code_in_gvisor_without_unsafe_local(compose_reward):
    env, server = compose_reward
    container = sh("docker", "compose", "ps", "-q", "reward", env=env).stdout.strip()
    host = sh("docker", "inspect", "--format",
              "{{.HostConfig.Runtime}} {{.HostConfig.Privileged}} {{json .HostConfig.CapAdd}}", container).stdout
    runtime, privileged, caps = host.split(maxsplit=2)
    assert (runtime, privileged) == ("runc", "false"), host
    assert sorted(json.loads(caps)) == ["KILL", "SETGID", "SETUID", "SYS_ADMIN", "SYS_CHROOT"], caps
    environment = sh("docker", "inspect", "--format", "{{json .Config.Env}}", container).stdout
    assert "UNSAFE_LOCAL" not in environment and "REDIS_URL" not in environment
    named = httpx.get(f"{server.url}/v1/sandbox", headers=server.headers, timeout=10).raise_for_status().json()
    assert named == {"sandbox": "gVisor (runsc), no cgroups", "isolated": True}, named
    log = sh("docker", "compose", "logs", "--no-color", "reward", env=env).stdout
    assert "gVisor: no cgroup per sandbox" in log and "UNSAFE" not in log, log[-3000:]
