"""Shared test fixtures: a real Redis per session, tiny models built from code.

Per-service fixtures (a shared vLLM engine, a reward server, ...) live in
``tests/fixtures/*.py`` and are loaded as plugins from here.
"""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server child process (embedded broker) for the whole session."""
    from broker.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return os.environ.get("TANDEM_TEST_REDIS_URL") or redis_server.url


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
    """A random 2-layer Qwen3 (char tokenizer, ~0.1M parameters) saved in HF format."""
    from learner.tiny import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3", seed=0)
