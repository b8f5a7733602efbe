"""cancel_and_wait: stopping a task from a task that may itself be cancelled meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from rollout_server.actor import cancel_and_wait


async def _slow_to_stop(stopping: asyncio.Event) -> None:
    """Like an actor: when cancelled it still cleans up for a while."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        stopping.set()
        await asyncio.sleep(0.2)
        raise


async def test_the_callers_own_cancel_is_not_swallowed():
    """The follower stops its actor at the end of a run; SIGTERM cancels the follower while it
    waits: the follower must end, not carry on serving (it once kept polling until SIGKILL)."""
    stopping = asyncio.Event()
    inner = asyncio.create_task(_slow_to_stop(stopping))
    carried_on = False

    async def follower():
        nonlocal carried_on
        await asyncio.sleep(0)
        await cancel_and_wait(inner)
        carried_on = True

    outer = asyncio.create_task(follower())
    await stopping.wait()  # the follower is now waiting for the actor's clean-up
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert not carried_on
    await asyncio.wait([inner])
    assert inner.cancelled()


async def test_returns_what_the_task_failed_with():
    async def fails():
        raise RuntimeError("engine died")

    failed = asyncio.create_task(fails())
    await asyncio.wait([failed])
    assert isinstance(await cancel_and_wait(failed), RuntimeError)

    stopped = asyncio.create_task(asyncio.sleep(3600))
    assert await cancel_and_wait(stopped) is None and stopped.cancelled()


class _SwallowingRegistry:
    """What redis-py 8.1 on Python 3.11 sometimes does with a cancellation that lands inside a
    command: the command completes and the cancellation is gone (a test double, no Redis)."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = asyncio.Event()

    async def report_in_use(self, server_id: str, version: int) -> None:
        self.calls += 1
        self.entered.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass

    async def wait_newer(self, version: int, timeout_s: float):
        return await self.report_in_use("", version)


@pytest.mark.parametrize("loop", ["_heartbeat", "_watch_weights"])
async def test_an_actor_loop_ends_although_redis_lost_its_cancellation(loop, monkeypatch):
    """Seen in the suite: a cancelled actor did not stop within 30 s, its heartbeat still running."""
    from types import SimpleNamespace

    from rollout_server import actor as actor_module

    monkeypatch.setattr(actor_module, "HEARTBEAT_S", 0.01)
    registry = _SwallowingRegistry()
    this = SimpleNamespace(registry=registry, server_id="s", engine=SimpleNamespace(version=0),
                           _hold=asyncio.Lock(), _evaluate_if_due=lambda: asyncio.sleep(0), _load=None)
    await this._hold.acquire()
    task = asyncio.create_task(getattr(actor_module.Actor, loop)(this))
    await registry.entered.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    if not done:  # a loop that lost the cancellation: end it so the session does not hang
        task.cancel()
        await asyncio.wait({task}, timeout=2)
    assert task in done and task.cancelled(), f"still looping after {registry.calls} calls"
