"""User tools the episode tests install beside the rollout server (``ToolBox(user=load_user_tools({...}))``,
as ``TANDEM_ROLLOUT_TOOLS`` names them): plain functions, never sent as code."""

from __future__ import annotations

import asyncio
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
