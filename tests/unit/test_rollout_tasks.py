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
