"""Shared test fixtures: a real Redis per session, tiny models built from code.

Per-service fixtures (a shared vLLM engine, a reward server, ...) live in
``tests/fixtures/*.py`` and are loaded as plugins from here.

Every process the session starts dies with it, even when pytest is killed: the session's owner tag
is in the environment every child inherits, and ``tests/reaper.py`` kills what carries it once
pytest is gone (:func:`pytest_configure`); the fixtures' direct children also get a parent-death
signal (``host.processes.die_with_parent``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)


ROOT = Path(__file__).resolve().parents[1]

HEAVY_FIXTURES = {
    "rollout_engine": "vllm",
    "learner_proc": "deepspeed",
    "one_rank_runs": "deepspeed",
    "two_rank_runs": "deepspeed",
}
"""Fixtures that start a heavy process, and the marker each gives every test that uses it, directly or
through another fixture (``make test-fast`` deselects the markers; a test that starts such a process
itself carries the marker in its module)."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    from tests.fixtures.background import uses_build

    for item in items:
        for marker in {m for f, m in HEAVY_FIXTURES.items() if f in item.fixturenames}:
            item.add_marker(marker)
        if hasattr(config, "workerinput"):  # a pytest-xdist worker (make test, make test-fast)
            item.add_marker(pytest.mark.xdist_group(_xdist_group(item, uses_build(item))))


def _xdist_group(item, uses_build: bool) -> str:
    """The tests one worker runs together (``--dist loadgroup``): those that use a background build
    (tests/fixtures/background.py: the worker that runs them owns the builds), those on the session's
    vLLM engine (one engine start, not one per worker), and otherwise a test file."""
    if uses_build:
        return "background-builds"
    if "rollout_engine" in item.fixturenames:
        return "vllm-engine"
    return item.nodeid.split("::")[0]


def pytest_configure(config):
    """Tag the session (below the tag pytest itself may carry) and start its reaper, from the main
    thread, before any fixture starts a process. The reaper runs in a session of its own and without
    the tag: it outlives pytest by design, and ends once it has reaped."""
    from host.processes import OWNER_VARIABLE, owner_tag

    if getattr(config, "_tandem_reaper", None) is not None:
        return
    tag = owner_tag(f"pytest-{os.getpid()}-{secrets.token_hex(4)}")
    env = {k: v for k, v in os.environ.items() if k != OWNER_VARIABLE}
    config._tandem_reaper = subprocess.Popen(
        [sys.executable, "-m", "tests.reaper", str(os.getpid()), tag], cwd=ROOT, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    os.environ[OWNER_VARIABLE] = tag


def _tree(path: Path) -> set[tuple[str, int]]:
    return {(str(p), p.stat().st_mtime_ns) for p in path.rglob("*")} if path.exists() else set()


@pytest.fixture(scope="session", autouse=True)
def writes_stay_in_tmp(tmp_path_factory):
    """Services started by tests keep their run directories under pytest's temporary directory
    (TANDEM_RUN_DIR, inherited by child processes), and the session fails if the repository's
    ``runs/`` changed."""
    before = _tree(ROOT / "runs")
    os.environ["TANDEM_RUN_DIR"] = str(tmp_path_factory.mktemp("run-dir"))
    yield
    changed = _tree(ROOT / "runs") ^ before
    assert not changed, f"tests wrote into the repository's runs/: {sorted(changed)[:5]}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server child process (embedded broker) for the whole session."""
    from broker.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return os.environ.get("TEST_REDIS_URL") or redis_server.url


@pytest.fixture
async def redis(redis_url):
    from broker import connect

    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def keys():
    """Key names of a fresh run: tests never see each other's data."""
    from broker import Keys

    return Keys(f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 2-layer Qwen3 (char tokenizer, ~0.1M parameters) saved in HF format. Its tokenizer has
    ``examples.tiny.CHAT_TEMPLATE``, so the session's engine serves chat messages too."""
    from examples.tiny import CHAT_TEMPLATE, tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3", seed=0, chat_template=CHAT_TEMPLATE)
