"""User tools in worker processes of their own, at most ``tool_workers`` of them per rollout server.

A user tool (``TANDEM_ROLLOUT_TOOLS``, ``{"name": "module:function"}``; ``rollout_server.tools``) is the
operator's code, but how often and how long it runs is the prompt set's: every episode of every group in
flight may call it at each turn. So it never runs in the rollout server's process: not on its event loop
(a coroutine that blocks would stall every request and every weight reload) and not in its default thread
pool (which the reload path and name lookups use; a plain function past its timeout used to keep its
thread there until it returned).

Each call runs in a worker process (``python -m rollout_server.tool_pool``) that imports the tools once
when it starts and then answers one call at a time over its pipes: a coroutine function is run to its end,
a plain one called. At most :attr:`ToolPool.size` workers exist (the server's ``tool_workers``): a call
beyond waits for a free one, within its own timeout. A call its caller abandons (its timeout, an episode
cancelled) kills its worker's process group, whatever the tool started included, and the next call starts
a fresh worker: nothing a tool does outlives the call that started it. A worker reads no ``TANDEM_*``
variable nor ``REDIS_URL`` (a tool has no use for the server's tokens), and what a tool prints goes to
the server's stderr, never into the answer.

Residual risk: a worker is an ordinary process of the server's user, with its file system and network;
this isolates the server's event loop, threads and memory from the tools, it is not a sandbox. Code from
a prompt set belongs in the ``python`` tool, which runs in the reward server's sandboxes.

This module imports only the standard library (and ``host.processes``), so a worker starts in tens of
milliseconds plus the tools' own imports.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable

from host.processes import die_with_parent, stop_group_async

MAX_RESULT_CHARS = 65536
"""A worker sends at most this much of a result (the observation keeps far less)."""
_PIPE_LIMIT = 4 * MAX_RESULT_CHARS + 1024  # a reply line: the result JSON-escaped, at worst 4 bytes a char


class ToolFailed(Exception):
    """The tool raised (message ``Class: message``), or its worker died or could not start."""


def import_tools(named: dict[str, str]) -> dict[str, Callable]:
    """``{"name": "module:function"}`` -> the functions, imported here (a worker; an error names the tool)."""
    out = {}
    for name, target in named.items():
        module, _, attr = target.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"tool {name!r}: cannot import {target!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"tool {name!r}: {target!r} is not a function")
        out[name] = fn
    return out


class ToolPool:
    """The worker processes of one rollout server's user tools ``named`` (module docstring): at most
    ``size`` at once. :meth:`start` before the first call (it checks that the tools import), :meth:`close`
    at the end."""

    def __init__(self, named: dict[str, str], size: int = 4) -> None:
        self.named = dict(named)
        self.size = size
        self._slots = asyncio.Semaphore(size)
        self._idle: list[asyncio.subprocess.Process] = []
        self._all: set[asyncio.subprocess.Process] = set()

    @property
    def names(self) -> set[str]:
        return set(self.named)

    @property
    def workers(self) -> int:
        """Worker processes alive now (idle or running a call)."""
        return sum(p.returncode is None for p in self._all)

    async def start(self) -> ToolPool:
        """Start one worker, so that a tool that cannot be imported stops the server now (``ValueError``)."""
        if self.named:
            try:
                self._idle.append(await self._spawn())
            except ToolFailed as e:
                raise ValueError(f"TANDEM_ROLLOUT_TOOLS: {e}") from None
        return self

    async def call(self, name: str, args: str) -> str:
        """The result of tool ``name`` on ``args`` as text; raises :class:`ToolFailed`. Cancelled, it kills
        the worker running the call."""
        async with self._slots:
            proc = self._idle.pop() if self._idle else await self._spawn()
            try:
                proc.stdin.write(json.dumps({"tool": name, "args": args}).encode() + b"\n")
                await proc.stdin.drain()
                line = await proc.stdout.readline()
            except BaseException:  # cancelled (the call's timeout), or the pipe broke: the worker goes
                await self._end(proc)
                raise
            if not line:
                raise ToolFailed(f"its worker process exited with code {await self._end(proc)}")
            self._idle.append(proc)
        reply = json.loads(line)
        if "error" in reply:
            raise ToolFailed(reply["error"])
        return reply["result"]

    async def close(self) -> None:
        """End every worker (and what its tool started)."""
        self._idle.clear()
        for proc in list(self._all):
            await self._end(proc)

    async def _spawn(self) -> asyncio.subprocess.Process:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollout_server.tool_pool", json.dumps({"tools": self.named, "path": sys.path}),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=_PIPE_LIMIT,
            start_new_session=True, preexec_fn=die_with_parent)
        self._all.add(proc)
        try:
            line = await proc.stdout.readline()
        except BaseException:
            await self._end(proc)
            raise
        reply = json.loads(line) if line else {"error": "its worker process exited at start"}
        if "ready" not in reply:
            await self._end(proc)
            raise ToolFailed(reply["error"])
        return proc

    async def _end(self, proc: asyncio.subprocess.Process) -> int:
        self._all.discard(proc)
        return await stop_group_async(proc)


def _serve(spec: dict) -> int:
    """A worker: import the tools, then answer one JSON line per call on the original stdout."""
    sys.path[:] = spec["path"]
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    calls = os.fdopen(os.dup(0), "r")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # what a tool prints goes to stderr, never into a reply

    def reply(**fields) -> None:
        replies.write(json.dumps(fields) + "\n")

    try:
        tools = import_tools(spec["tools"])
    except ValueError as e:
        reply(error=str(e))
        return 1
    reply(ready=True)
    for line in calls:
        call = json.loads(line)
        try:
            out = tools[call["tool"]](call["args"])
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            reply(result=str(out)[:MAX_RESULT_CHARS])
        except Exception as e:  # noqa: BLE001  the tool's failure is the model's to read
            reply(error=f"{e.__class__.__name__}: {e}")
    return 0


async def _awaited(aw):
    return await aw


if __name__ == "__main__":
    sys.exit(_serve(json.loads(sys.argv[1])))
