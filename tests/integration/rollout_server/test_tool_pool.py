"""User tools in worker processes of their own (rollout_server.tool_pool), within the operator's limits
(rollout_server.tools, **Limits**): real worker processes and real slow tools; and a flood of slow tool
calls against the session's real vLLM engine reloading its weights."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from rollout_server.tools import Call, ToolBox, ToolLimits, user_tools
from tests.fixtures.rollout import Incidents

TOOLS = {name: f"tests.episode_tools:{name}" for name in
         ("reverse", "failing", "hanging", "hanging_async", "pid", "chatty", "env", "exiting", "slow", "slow_blocking")}
ALL = [*TOOLS, "calculator"]


@pytest.fixture
async def pool():
    pool = await user_tools(TOOLS, 2)
    yield pool
    await pool.close()
    assert pool.workers == 0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_user_tools_run_in_worker_processes_that_see_no_tandem_secret(pool, monkeypatch):
    s = ToolBox(user=pool).session()
    assert await s.answer(Call("reverse", "abc"), ALL, 10) == "<result>cba</result>"
    worker = int((await s.answer(Call("pid", ""), ALL, 10))[len("<result>"):-len("</result>")])
    assert worker != os.getpid() and _alive(worker)
    # what a tool prints is not its answer; a tool's failure or its worker's death is an observation
    assert await s.answer(Call("chatty", "hi"), ALL, 10) == "<result>hi</result>"
    assert await s.answer(Call("failing", "x"), ALL, 10) == (
        "<error>the tool 'failing' failed: RuntimeError: cannot look up 'x'</error>")
    assert await s.answer(Call("exiting", ""), ALL, 10) == (
        "<error>the tool 'exiting' failed: its worker process exited with code 3</error>")
    assert await s.answer(Call("reverse", "ok"), ALL, 10) == "<result>ko</result>"
    # the server's token is not in a worker's environment (workers started from now on)
    monkeypatch.setenv("TANDEM_TOKEN", "server-secret")
    await pool.close()
    assert await s.answer(Call("env", "TANDEM_TOKEN"), ALL, 10) == "<result>None</result>"


async def test_a_tool_that_cannot_be_imported_stops_the_server_at_start():
    with pytest.raises(ValueError, match="TANDEM_ROLLOUT_TOOLS: tool 'r': cannot import 'tests.episode_tools:absent'"):
        await user_tools({"r": "tests.episode_tools:absent"}, 1)


async def test_a_call_past_its_timeout_kills_its_worker_and_the_next_call_gets_a_new_one():
    pool = await user_tools(TOOLS, 1)
    try:
        s = ToolBox(user=pool, sink=Incidents()).session()
        for name in ("hanging", "hanging_async"):
            before = int((await s.answer(Call("pid", ""), ALL, 10))[len("<result>"):-len("</result>")])
            t0 = time.monotonic()
            assert await s.answer(Call(name, ""), ALL, 0.5) == f"<error>the tool {name!r} timed out after 0.5 s</error>"
            assert time.monotonic() - t0 < 3
            for _ in range(50):  # the kill is on its way as the observation is returned
                if not _alive(before):
                    break
                await asyncio.sleep(0.05)
            assert not _alive(before), "the hung tool's worker still runs"
            after = int((await s.answer(Call("pid", ""), ALL, 10))[len("<result>"):-len("</result>")])
            assert after != before and _alive(after)
        assert [i.field for i in s.box.sink.got] == ["episode.tool_timeout_s"] * 2
    finally:
        await pool.close()


async def test_the_servers_limits_bound_each_call_each_episode_and_the_server(pool):
    box = ToolBox(user=pool, limits=ToolLimits(call_s=2.0, episode_s=4.0), sink=Incidents())
    # per call: a line's 30 s is lowered to the server's 2 s (room for a fresh worker's start on a loaded machine)
    s = box.session()
    assert await s.answer(Call("slow", "5"), ALL, 30) == "<error>the tool 'slow' timed out after 2 s</error>"
    assert box.sink.got[-1].field == "TANDEM_ROLLOUT_TOOL_TIMEOUT_S"
    # per episode: 4 s of tool time in all, then every call is refused; a line's smaller budget wins
    assert await s.answer(Call("slow", "0.4"), ALL, 30) == "<result>slept</result>"
    seen = await s.answer(Call("slow", "5"), ALL, 30)
    assert re.fullmatch(r"<error>the tool 'slow' timed out after (0|1)\.\d+ s</error>", seen) and s.spent_s >= 4.0, seen
    assert box.sink.got[-1].field == "TANDEM_ROLLOUT_TOOL_EPISODE_S"
    assert await s.answer(Call("reverse", "a"), ALL, 30) == (
        "<error>this episode's tool time is spent (4 s, TANDEM_ROLLOUT_TOOL_EPISODE_S)</error>")
    short = box.session(0.3)
    assert await short.answer(Call("slow", "5"), ALL, 30) == "<error>the tool 'slow' timed out after 0.3 s</error>"
    assert box.sink.got[-1].field == "episode.tool_budget_s"
    # per server: six calls at once run two at a time, in at most two worker processes
    box = ToolBox(user=pool)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, pool.workers)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    t0 = time.monotonic()
    seen = await asyncio.gather(*[box.session().answer(Call("slow", "0.5"), ALL, 30) for _ in range(6)])
    wall = time.monotonic() - t0
    watcher.cancel()
    assert seen == ["<result>slept</result>"] * 6
    assert peak == 2 and wall >= 1.5


# -- a flood of slow tool calls and a weight reload, on the session's engine ----------------------------

SPY = Path(__file__).resolve().parents[2] / "fixtures" / "modal_spy" / "modal" / "__init__.py"
SLOW_S = 8.0


@pytest.mark.usefixtures("engine_left_serving")
async def test_a_flood_of_slow_tool_calls_does_not_delay_a_weight_reload(
    rollout_engine, weight_versions, serve_app, monkeypatch, tmp_path
):
    """A prompt set may have every episode call the server's slowest tool at once. Here 18 calls of two
    slow tools (a plain function and a coroutine that blocks its event loop, each taking 8 s) are in flight
    on a rollout server whose engine reloads its weights from a Modal Volume (the volume's reload is the
    step of a reload that ran in the server's default thread pool; Modal's cloud is the spy of
    tests/fixtures/modal_spy). The reload takes no longer than without the flood, the server's event loop
    and default thread pool stay free, and at most ``tool_workers`` tool processes run."""
    from pydantic import SecretStr

    from rollout_server import build_app
    from rollout_server.settings import RolloutSettings

    spec = importlib.util.spec_from_file_location("modal", SPY)
    spy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(spy)
    monkeypatch.setitem(sys.modules, "modal", spy)
    monkeypatch.setenv("SPY_MODAL_VOLUME_VIEW", str(tmp_path / "view"))
    monkeypatch.setenv("SPY_MODAL_VOLUME_STORE", str(tmp_path / "store"))
    monkeypatch.setattr(rollout_engine, "volume", "runs")

    t0 = time.monotonic()
    await rollout_engine.load_weights(weight_versions.make(seed=11))
    alone_s = time.monotonic() - t0

    rs = RolloutSettings(token=SecretStr("a-test-token-of-enough-length"), tools=TOOLS, tool_workers=2)
    async with serve_app(build_app(rs, engine=rollout_engine)) as running:
        tools = running.app.state.tools
        t0 = time.monotonic()  # from the flood on: a tool that blocks the event loop delays all that follows
        flood = [asyncio.create_task(tools.session().answer(Call(name, str(SLOW_S)), ALL, SLOW_S + 2))
                 for name in ["slow"] * 16 + ["slow_blocking"] * 2]
        try:
            await asyncio.sleep(0.5)  # the calls are in flight
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, time.monotonic), SLOW_S / 2)
            pool_s = time.monotonic() - t0 - 0.5
            t1 = time.monotonic()
            await asyncio.wait_for(rollout_engine.load_weights(weight_versions.make(seed=12)), SLOW_S * 4)
            flooded_s = time.monotonic() - t1 + pool_s
            early = sum(t.done() for t in flood)  # calls over before the reload was: none, each takes 8 s
            assert tools.user.workers <= 2
        finally:
            for t in flood:
                t.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    assert pool_s < 1.0, f"the default thread pool answered after {pool_s:.1f} s"
    assert early == 0, f"{early} tool calls were over before the reload was: it took {flooded_s:.1f} s"
    assert flooded_s < alone_s + SLOW_S / 2, f"the reload took {flooded_s:.1f} s under the flood, {alone_s:.1f} s alone"
    assert [json.loads(c)["call"] for c in (tmp_path / "calls.jsonl").read_text().splitlines()] == ["reload"] * 2
