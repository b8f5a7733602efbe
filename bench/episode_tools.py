"""The user tools of bench/episodes.py, named in its tool pool (``bench.episode_tools:NAME``) and imported by
the pool's worker processes: a module of its own, so that a worker starts without the bench's imports."""

from __future__ import annotations

import asyncio
import os

CAPITALS = {"paris": "france", "rome": "italy", "madrid": "spain"}
REMOTE_S = 0.2
REMOTE_VARIABLE = "BENCH_EPISODES_REMOTE_S"
"""The 'remote' tool's wait, given to the pool's workers through their environment."""


def lookup(args: str) -> str:
    """A plain user tool."""
    return CAPITALS.get(args.strip(), "unknown")


async def remote(args: str) -> str:
    """A coroutine user tool that waits (a remote API, say; :data:`REMOTE_VARIABLE`) and answers its args
    in capitals."""
    await asyncio.sleep(float(os.environ.get(REMOTE_VARIABLE, REMOTE_S)))
    return args.strip().upper()
