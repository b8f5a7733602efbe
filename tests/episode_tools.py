"""User tools the episode tests install beside the rollout server (``ToolPool({"name": "tests.episode_tools:f"})``,
as ``TANDEM_ROLLOUT_TOOLS`` names them): plain functions, never sent as code, run in the pool's workers."""

from __future__ import annotations

import asyncio
import os
import time


def reverse(args: str) -> str:
    return args[::-1]


def failing(args: str) -> str:
    raise RuntimeError(f"cannot look up {args!r}")


def hanging(args: str) -> str:
    """A synchronous tool that hangs (well past any test's tool timeout)."""
    time.sleep(30)
    return "too late"


async def hanging_async(args: str) -> str:
    await asyncio.sleep(30)
    return "too late"


NOT_A_FUNCTION = 3


def pid(args: str) -> str:
    """The process the tool runs in."""
    return str(os.getpid())


def chatty(args: str) -> str:
    print("a tool's own output, not its answer")
    return args


def env(args: str) -> str:
    return repr(os.environ.get(args))


def exiting(args: str) -> str:
    os._exit(3)


def slow(args: str) -> str:
    """A plain tool that takes ``args`` seconds (a slow remote lookup, say)."""
    time.sleep(float(args))
    return "slept"


async def slow_blocking(args: str) -> str:
    """A coroutine tool that blocks whatever event loop runs it for ``args`` seconds."""
    time.sleep(float(args))
    return "slept"
