"""The sandbox interface every backend implements, and the job format they share.

A :class:`Job` is what the verifiers ask for: some files, one or more runs of
a program against them, under :class:`~services.reward_specs.Limits`. Every backend
hands the job to the same in-sandbox supervisor (``guest/agent.py``) as one
frame (4-byte big-endian length + JSON) and reads one frame back, so limits
and verdicts mean the same thing under gVisor, bubblewrap and Modal.

Errors: a backend raises :class:`SandboxError` when the *infrastructure*
failed (the sandbox did not start, the supervisor died, the answer was
garbage). The scorer turns that into ``sandbox_error``, never into a score.
"""

from __future__ import annotations

import asyncio
import json
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from services.reward_specs import Limits
from services.wire import ExecStatus

HEADER = struct.Struct(">I")
MAX_ANSWER_BYTES = 512 << 20

# Paths inside the sandbox: the guest code directory and the launchers in it.
GUEST_MOUNT = "/opt/tandem"
BOOT = "{guest}/boot.py"
HARNESS = "{guest}/harness.py"


class SandboxError(Exception):
    """The sandbox infrastructure failed; the program was not judged."""


class SandboxUnavailable(SandboxError):
    """No sandbox can run here (and unsafe local execution is off)."""


@dataclass(frozen=True)
class Run:
    """One process: ``argv`` inside the sandbox (``{guest}`` and ``{results_fd}`` are filled
    in by the agent), its stdin, and whether it reports per-test results."""

    argv: list[str]
    stdin: str = ""
    results: bool = False


@dataclass(frozen=True)
class Job:
    """Files written to a fresh work dir, then ``runs`` one after another in it."""

    files: dict[str, str]
    runs: list[Run]
    limits: Limits = field(default_factory=Limits)

    def frame(self) -> bytes:
        body = json.dumps(
            {
                "files": self.files,
                "runs": [{"argv": r.argv, "stdin": r.stdin, "results": r.results} for r in self.runs],
                "limits": self.limits.model_dump(),
            }
        ).encode()
        return HEADER.pack(len(body)) + body

    def backstop_s(self) -> float:
        """How long tandem waits for the agent's answer before it kills the sandbox.

        The agent enforces each run's wall limit itself; this covers an agent that
        cannot answer (a starved or wedged sandbox)."""
        return len(self.runs) * (self.limits.wall_s + 1.0) + 5.0


@dataclass(frozen=True)
class RunOutcome:
    status: ExecStatus
    detail: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    truncated: bool
    results: list[dict[str, Any]] | None = None


def unanswered(job: Job, detail: str = "sandbox unresponsive past the wall limit; killed") -> list[RunOutcome]:
    """The verdicts of every run when the sandbox itself did not answer within :meth:`Job.backstop_s`."""
    return [RunOutcome(status="timeout", detail=detail, exit_code=None, stdout="", stderr="",
                       wall_s=job.backstop_s(), cpu_s=0.0, truncated=False) for _ in job.runs]


def python_run(python: str, main: str = "main.py", stdin: str = "") -> Run:
    """Run ``main`` through the compile-checking launcher."""
    return Run(argv=[python, "-I", BOOT, main], stdin=stdin)


def harness_run(python: str, tests: list[str], wall_s: float, solution: str = "solution.py") -> Run:
    """Run assert-style tests against ``solution`` with per-test results (``guest/harness.py``).

    The tests travel on the harness's stdin, never as a file in the work dir, where the program
    could read them; ``wall_s`` (the job's wall limit) lets the harness end a hung program itself."""
    return Run(argv=[python, "-I", HARNESS, solution, repr(float(wall_s)), "{results_fd}"],
               stdin=json.dumps(tests), results=True)


def parse_answer(body: bytes, job: Job) -> list[RunOutcome]:
    """The agent's answer frame body -> one outcome per run; SandboxError if it is not one."""
    try:
        answer = json.loads(body)
    except ValueError as e:
        raise SandboxError(f"agent answered garbage: {e}") from e
    if not isinstance(answer, dict):
        raise SandboxError("agent answer is not an object")
    if answer.get("error"):
        raise SandboxError(f"agent failed: {answer['error']}")
    runs = answer.get("runs")
    if not isinstance(runs, list) or len(runs) != len(job.runs):
        raise SandboxError("agent answered the wrong number of runs")
    try:
        return [
            RunOutcome(
                status=r["status"], detail=r["detail"], exit_code=r["exit_code"], stdout=r["stdout"],
                stderr=r["stderr"], wall_s=r["wall_s"], cpu_s=r["cpu_s"], truncated=r["truncated"],
                results=r["results"],
            )
            for r in runs
        ]
    except (KeyError, TypeError) as e:
        raise SandboxError(f"agent answer lacks a field: {e}") from e


async def read_answer(stream: asyncio.StreamReader) -> bytes:
    """One frame body from the agent; SandboxError if the stream ends first."""
    try:
        head = await stream.readexactly(HEADER.size)
        (size,) = HEADER.unpack(head)
        if size > MAX_ANSWER_BYTES:
            raise SandboxError(f"agent answer of {size} bytes")
        return await stream.readexactly(size)
    except asyncio.IncompleteReadError as e:
        raise SandboxError("sandbox exited before answering") from e


class Sandbox(ABC):
    """A place to run untrusted code. Implementations are safe to call concurrently."""

    name: str = "sandbox"
    python: str = "/usr/bin/python3"
    """The interpreter's path inside the sandbox."""
    isolated: bool = True
    """False only for the unsafe local backend."""

    async def start(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Start warm resources (pools); optional."""

    @abstractmethod
    async def run(self, job: Job) -> list[RunOutcome]:
        """Run ``job``; raise :class:`SandboxError` on infrastructure failure."""

    async def close(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Release every process and resource this sandbox owns."""
