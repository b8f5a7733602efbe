"""The stack starts its services at once, and one that fails to start stops the whole stack.

Real services (reward server, control plane) and a real embedded Redis, under
:class:`deploy.stack.Stack` as ``tandem up`` runs it; the two are the
quickest to start, which keeps the test short.
"""

from __future__ import annotations

import os
import time

import pytest

from deploy.settings import StackSettings
from deploy.stack import Stack, StackError


@pytest.fixture
def clean_env(monkeypatch):
    """The caller's environment without TANDEM_* or REDIS_URL (the stack passes it to the services)."""
    for key in list(os.environ):
        if key.startswith("TANDEM_") or key == "REDIS_URL":
            monkeypatch.delenv(key)
    return monkeypatch


def _recorder(lines: list[tuple[float, str]]):
    return lambda line: lines.append((time.monotonic(), line))


def test_services_start_at_once(tmp_path, clean_env):
    """Each service is spawned before any other is ready: starting takes the slowest one's time, not the sum."""
    lines: list[tuple[float, str]] = []
    stack = Stack(tmp_path / "stack", StackSettings(), services=("reward", "control"), echo=_recorder(lines))
    with stack:
        spawned = {name: child.started_at for name, child in stack.children.items()}
        ready = {line.split()[1]: t for t, line in lines if line.startswith("[stack]") and " ready at " in line}
        assert sorted(ready) == ["control", "reward"], lines
        assert max(spawned.values()) < min(ready.values()), (spawned, ready)
        assert all(child.proc.poll() is None for child in stack.children.values())


def test_torch_compile_cache_outlives_the_run(tmp_path, clean_env):
    """What torch.compile builds is kept in the user's cache (private), found by the next run's stack."""
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # torch's inductor writes its default into this process's environment once it has run (an earlier
    # test); a user's own TORCHINDUCTOR_CACHE_DIR wins over the stack's choice, so take it away here
    clean_env.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    caches = {Stack(tmp_path / f"run-{i}", StackSettings())._env({})["TORCHINDUCTOR_CACHE_DIR"] for i in (1, 2)}
    assert caches == {str(tmp_path / "cache" / "tandem" / "torchinductor")}
    assert (tmp_path / "cache" / "tandem" / "torchinductor").stat().st_mode & 0o777 == 0o700


def test_a_service_that_fails_to_start_stops_the_stack_naming_it_and_its_log(tmp_path, clean_env):
    clean_env.setenv("TANDEM_CONTROL_MAX_PROMPT_SET_LINES", "0")  # refused by the control plane's settings
    lines: list[tuple[float, str]] = []
    stack = Stack(tmp_path / "stack", StackSettings(), services=("reward", "control"), echo=_recorder(lines))
    with pytest.raises(StackError) as failed:
        stack.start()
    message = str(failed.value)
    assert message.startswith("control exited with code "), message
    assert str(tmp_path / "stack" / "logs" / "control.log") in message
    assert "max_prompt_set_lines" in (tmp_path / "stack" / "logs" / "control.log").read_text()
    # stop-on-failure: the reward server, started beside it, is stopped with the stack
    assert all(child.proc.poll() is not None for child in stack.children.values())
    assert stack.redis is None
