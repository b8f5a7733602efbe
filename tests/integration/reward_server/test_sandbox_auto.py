"""``TANDEM_REWARD_SANDBOX=auto`` (the default) picks gVisor when runsc works, bubblewrap when it does
not, and refuses to run code when neither works (or runs it on the host, only with ``unsafe_local``).

Each step is the real reward app (lifespan run, in-process) on this host's real binaries, with
``PATH`` taken down one binary at a time: a directory of links to every program on ``PATH`` but
the ones removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from deploy.stack import wait_healthy
from host.processes import stop_groups
from tests.fixtures.reward import spawn_server

CODE = {"code": "print(6 * 7)"}


@pytest.fixture
def path_without(monkeypatch):
    """``path_without("runsc", ...)``: PATH becomes one directory of links to every program on it but those.

    The directory is world-readable, outside pytest's 0700 tree: as root, bubblewrap is started as an
    unprivileged uid, which must be able to reach the link it is started through."""
    made = []

    def make(*removed: str) -> None:
        bin_dir = Path(tempfile.mkdtemp(prefix="tandem-path-"))
        made.append(bin_dir)
        bin_dir.chmod(0o755)
        for directory in os.environ["PATH"].split(os.pathsep):
            if not directory or not Path(directory).is_dir():
                continue
            for entry in Path(directory).iterdir():
                link = bin_dir / entry.name
                if entry.name not in removed and not link.exists() and os.access(entry, os.X_OK):
                    link.symlink_to(entry)
        monkeypatch.setenv("PATH", str(bin_dir))

    yield make
    for bin_dir in made:
        shutil.rmtree(bin_dir)


async def _runs_code(client) -> dict:
    r = await client.post("/v1/execute", json=CODE)
    assert r.status_code == 200, r.text
    return r.json()


async def test_auto_picks_gvisor_when_runsc_works(reward_app):
    async with reward_app(sandbox="auto", workers=1) as (app, client):
        assert app.state.sandbox_description.startswith("gVisor (runsc)"), app.state.sandbox_description
        assert (await _runs_code(client))["stdout"] == "42\n"
        named = (await client.get("/v1/sandbox")).json()
        assert named == {"sandbox": app.state.sandbox_description, "isolated": True}, named


async def test_auto_falls_back_to_bubblewrap_without_runsc(reward_app, path_without):
    path_without("runsc")
    async with reward_app(sandbox="auto", workers=1) as (app, client):
        assert app.state.sandbox_description.startswith("bubblewrap"), app.state.sandbox_description
        assert (await _runs_code(client))["stdout"] == "42\n"


async def test_auto_refuses_code_without_runsc_and_bwrap(reward_app, path_without):
    path_without("runsc", "bwrap")
    async with reward_app(sandbox="auto", workers=1) as (app, client):
        assert app.state.sandbox_description == "gvisor: runsc not found; bwrap: bwrap not found"
        refused = await client.post("/v1/execute", json=CODE)
        assert refused.status_code == 503, refused.text
        assert "unsafe_local" in refused.json()["detail"]
        assert (await client.get("/v1/sandbox")).json() == {"sandbox": app.state.sandbox_description,
                                                              "isolated": False}


async def test_auto_runs_code_on_the_host_only_with_unsafe_local(reward_app, path_without):
    path_without("runsc", "bwrap")
    async with reward_app(sandbox="auto", workers=1, unsafe_local=True) as (app, client):
        assert app.state.sandbox_description == (
            "UNSAFE local execution without isolation (gvisor: runsc not found; bwrap: bwrap not found)")
        assert (await _runs_code(client))["stdout"] == "42\n"
        assert (await client.get("/v1/sandbox")).json()["isolated"] is False


def test_the_served_reward_server_says_where_code_runs(reward_secret, tmp_path):
    """``tandem serve reward`` at the default log level writes the sandbox it chose at start-up to its log
    (``services.serving.log_to_stderr``): an operator sees where completions run without asking the API."""
    log_path = tmp_path / "reward.log"
    proc, url = spawn_server("bwrap", reward_secret, log_path, workers=1, log_level="info")
    try:
        wait_healthy(proc, url, 90, log_path)
    finally:
        stop_groups([proc])
    assert "reward server: code runs in bubblewrap" in log_path.read_text(), log_path.read_text()[-2000:]
