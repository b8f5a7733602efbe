"""Episode tools against the real reward server's sandboxes (gVisor and bubblewrap, ``tandem serve reward``)
and user tools that fail or hang: every outcome is an observation the model reads, never an exception,
and one episode's Python session is closed to every other (rollout_server.tools)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import Call, ToolBox, user_tools
from services.clients import RewardClient
from tests.fixtures.reward import REWARD_TOKEN
from tests.fixtures.rollout import Incidents


@pytest.fixture
async def box(one_worker_reward_server):
    """Tools backed by a reward server with ONE sandbox worker: consecutive calls of different episodes
    run in the same worker (under gVisor, the same sandbox), so what one leaves behind is there to find."""
    client = RewardClient(one_worker_reward_server.url, REWARD_TOKEN, attempts=1, max_total_s=60)
    user = await user_tools({"reverse": "tests.episode_tools:reverse", "failing": "tests.episode_tools:failing",
                             "hanging": "tests.episode_tools:hanging",
                             "hanging_async": "tests.episode_tools:hanging_async"}, 2)
    yield ToolBox(reward=client, user=user, sink=Incidents(), source="rollout:test",
                  metrics=RolloutMetrics(CollectorRegistry()))
    await user.close()
    await client.aclose()


ALL = ["calculator", "python", "reverse", "failing", "hanging", "hanging_async"]


async def test_a_python_session_keeps_its_state_and_no_other_episode_sees_it(box, reward_secret):
    a, b = box.session(), box.session()
    marker = uuid.uuid4().hex
    assert await a.answer(Call("python", f"x = 41\nsecret = {marker!r}\n_ = open('left', 'w').write(secret)"),
                          ALL, 30) == "<result></result>"
    assert await a.answer(Call("python", "print('ok')\nx + 1"), ALL, 30) == "<result>ok\n42</result>"
    assert await a.answer(Call("python", "open('left').read() == secret"), ALL, 30) == "<result>True</result>"
    # episode b, in the same worker right after: none of a's names, none of a's files
    seen = await b.answer(Call("python", "print(x)"), ALL, 30)
    assert seen.startswith("<error>runtime_error") and "NameError" in seen and marker not in seen
    seen = await b.answer(Call("python", "import os\nprint(os.path.exists('left'), os.listdir('.'))"), ALL, 30)
    assert seen == "<result>False ['main.py']</result>"  # its own program only
    # nor the host's: the planted secret file and environment variable
    seen = await b.answer(Call("python", f"import os\nprint(os.environ.get({reward_secret.env_name!r}))\n"
                                         f"print(open({str(reward_secret.path)!r}).read())"), ALL, 30)
    assert seen.startswith("<error>runtime_error") and "None" in seen and reward_secret.value not in seen
    assert (a.calls, a.errors, b.calls, b.errors) == (3, 0, 3, 2)
    assert a.python.cells != b.python.cells


@pytest.mark.slow  # over 5 s in make test-fast (docs/testing.md): make test runs it
async def test_a_failing_cell_is_an_error_and_the_session_goes_on(box):
    s = box.session()
    assert await s.answer(Call("python", "y = 2"), ALL, 30) == "<result></result>"
    seen = await s.answer(Call("python", "y / 0"), ALL, 30)
    assert seen == "<error>runtime_error: ZeroDivisionError: division by zero</error>"
    t0 = time.monotonic()
    seen = await s.answer(Call("python", "while True:\n    pass"), ALL, 30)  # the sandbox's wall limit ends it
    assert seen.startswith("<error>timeout") and time.monotonic() - t0 < 20
    # neither failing cell is replayed: the next call sees y and nothing of them
    assert await s.answer(Call("python", "y * 21"), ALL, 30) == "<result>42</result>"
    assert (s.calls, s.errors) == (4, 2)
    calls = box.metrics.registry.get_sample_value
    assert [calls("tandem_rollout_tool_calls_total", {"tool": "python", "outcome": o}) for o in ("ok", "error", "timeout")] \
        == [2, 1, 1]
    assert calls("tandem_rollout_tool_call_seconds_count", {"tool": "python"}) == 4


async def test_user_tools_failures_and_timeouts_are_observations(box):
    s = box.session()
    assert await s.answer(Call("reverse", "abc"), ALL, 5) == "<result>cba</result>"
    assert await s.answer(Call("calculator", "123+456"), ALL, 5) == "<result>579</result>"
    assert await s.answer(Call("failing", "x"), ALL, 5) == (
        "<error>the tool 'failing' failed: RuntimeError: cannot look up 'x'</error>")
    assert await s.answer(Call("reverse", "abc"), ["calculator"], 5) == (
        "<error>unknown tool 'reverse'; this episode allows: calculator</error>")
    assert await s.answer(Call(error="malformed call: </tool> without <tool>"), ALL, 5) == (
        "<error>malformed call: </tool> without <tool></error>")
    for name in ("hanging", "hanging_async"):
        t0 = time.monotonic()
        assert await s.answer(Call(name, "x"), ALL, 0.5) == f"<error>the tool {name!r} timed out after 0.5 s</error>"
        assert time.monotonic() - t0 < 3
    assert [(i.field, i.what, i.source) for i in box.sink.got] == [
        ("episode.tool_timeout_s", "tool call hanging", "rollout:test"),
        ("episode.tool_timeout_s", "tool call hanging_async", "rollout:test")]
    assert (s.calls, s.errors) == (7, 5)
    calls = box.metrics.registry.get_sample_value
    assert {(tool, o): calls("tandem_rollout_tool_calls_total", {"tool": tool, "outcome": o})
            for tool, o in [("reverse", "ok"), ("calculator", "ok"), ("failing", "error"), ("-", "refused"),
                            ("hanging", "timeout"), ("hanging_async", "timeout")]} == {
        ("reverse", "ok"): 1, ("calculator", "ok"): 1, ("failing", "error"): 1, ("-", "refused"): 2,
        ("hanging", "timeout"): 1, ("hanging_async", "timeout"): 1}


async def test_a_reward_server_that_cannot_be_reached_is_an_observation():
    client = RewardClient("http://127.0.0.1:9", REWARD_TOKEN, attempts=1, max_total_s=5)
    try:
        s = ToolBox(reward=client).session()
        seen = await asyncio.wait_for(s.answer(Call("python", "print(1)"), ["python"], 10), 20)
        assert seen.startswith("<error>the tool 'python' failed: ConnectError")
    finally:
        await client.aclose()
