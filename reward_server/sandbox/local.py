"""Unsafe local "sandbox": the agent runs straight on the host. Only with ``unsafe_local = true``.

Limits (time, memory, output, processes via rlimits) still apply, but the
program sees the host's file system and network. For development machines
without gVisor or bubblewrap; the server says so loudly at start-up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile

from host.processes import stop_group_async
from reward_server.sandbox.base import (
    Job,
    RunOutcome,
    Sandbox,
    SandboxError,
)
from reward_server.sandbox.blame import read_verdicts, run_blaming
from reward_server.sandbox.guest import GUEST_DIR


class LocalSandbox(Sandbox):
    name = "unsafe_local"
    isolated = False

    def __init__(self, python: str = "/usr/bin/python3") -> None:
        # When root, the agent runs programs under throw-away uids: interpreter and guest code
        # must be readable by them (a venv under /root is not), so use a system Python and a copy.
        self.python = os.path.realpath(python if os.access(python, os.X_OK) else sys.executable)
        self._dir = tempfile.mkdtemp(prefix="tandem-unsafe-")
        os.chmod(self._dir, 0o711)
        self._guest = os.path.join(self._dir, "guest")
        shutil.copytree(GUEST_DIR, self._guest, ignore=shutil.ignore_patterns("__pycache__"))
        self._work = os.path.join(self._dir, "work")
        os.mkdir(self._work, 0o711)

    async def run(self, job: Job) -> list[RunOutcome]:
        return await run_blaming(self._attempt, job, self.python)

    async def _attempt(self, job: Job) -> list[RunOutcome]:
        proc = await asyncio.create_subprocess_exec(
            self.python, "-I", os.path.join(self._guest, "agent.py"), "--oneshot", self._work,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
            limit=1 << 20, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(job.frame())
            await proc.stdin.drain()
            proc.stdin.close()
            return await asyncio.wait_for(read_verdicts(proc.stdout, job), job.backstop_s())
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as e:
            raise SandboxError(f"local agent failed: {e!r}") from e
        finally:
            await stop_group_async(proc)  # the agent exits after answering; this ends a wedged one

    async def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
