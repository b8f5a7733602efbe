"""Who ended a sandbox mid-job: the infrastructure (``sandbox_error``) or the job (a score of 0).

``sandbox_error`` drops a whole group from training, so a completion that
could end its own sandbox would turn its low score into "no score" for all
its siblings. The agent therefore answers ``{"accepted": true}`` as soon as
it holds the job's files, before any program runs, and the backends read
the answer with :func:`read_verdicts`:

- no ``accepted`` (the sandbox did not start, the agent failed before
  running anything, garbage): :class:`~.base.SandboxError`, infrastructure;
- ``accepted`` and then the stream ends, or the agent answers an error:
  :class:`SandboxEnded`. If the job's cgroup saw an OOM kill, the job ran
  out of memory: every run is ``memory_limit``. Otherwise :func:`run_blaming`
  runs the job once more in a fresh sandbox. If the second try answers, the
  first end was the host's, and its answer stands. If it ends too, a
  trivial canary job runs: when the canary is answered, the sandboxes work
  and the job is what ends them, so every run is ``runtime_error`` ("the
  program ended its sandbox"); when the canary fails as well, the
  infrastructure is broken and the job gets ``sandbox_error`` after all
  (a systematic failure must never turn into a wave of zero rewards).

So a program that kills its agent or its sandbox scores 0 with a program
failure status, and one host hiccup costs a re-run, not a group.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from reward_server.sandbox.base import (
    Job,
    RunOutcome,
    SandboxError,
    parse_answer,
    python_run,
    read_answer,
)
from services.reward_specs import Limits

ACCEPTED = {"accepted": True}


class SandboxEnded(SandboxError):
    """The sandbox ended after the agent accepted the job, while its programs ran."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


def is_accepted(body: bytes) -> bool:
    try:
        return json.loads(body) == ACCEPTED
    except ValueError:
        return False


async def read_verdicts(stream: asyncio.StreamReader, job: Job) -> list[RunOutcome]:
    """The agent's ``accepted`` frame, then its answer; :class:`SandboxEnded` if it ends in between."""
    first = await read_answer(stream)
    if not is_accepted(first):
        return parse_answer(first, job)  # an error answer (SandboxError) or an agent that ran nothing
    try:
        return parse_answer(await read_answer(stream), job)
    except SandboxError as e:
        raise SandboxEnded(f"the sandbox ended while the job ran: {e}") from e


def ended_by_job(job: Job, out_of_memory: bool) -> list[RunOutcome]:
    """Every run's verdict when the job ended its sandbox."""
    status, detail = (("memory_limit", "the job's processes together ran out of memory; its sandbox was killed")
                      if out_of_memory else ("runtime_error", "the program ended its sandbox"))
    return [RunOutcome(status=status, detail=detail, exit_code=None, stdout="", stderr="", wall_s=0.0, cpu_s=0.0,
                       truncated=False) for _ in job.runs]


def canary(python: str) -> Job:
    """The smallest job: proof that sandboxes answer."""
    return Job(files={"main.py": "pass\n"}, runs=[python_run(python)], limits=Limits(wall_s=10, cpu_s=5))


async def run_blaming(attempt: Callable[[Job], Awaitable[list[RunOutcome]]], job: Job,
                      python: str) -> list[RunOutcome]:
    """``attempt(job)`` in a fresh sandbox each time, with the policy of the module docstring."""
    try:
        return await attempt(job)
    except SandboxEnded as first:
        if first.out_of_memory:
            return ended_by_job(job, out_of_memory=True)
    try:
        return await attempt(job)
    except SandboxEnded as second:
        if second.out_of_memory:
            return ended_by_job(job, out_of_memory=True)
        reason = second
    try:
        (check,) = await attempt(canary(python))
    except SandboxError as e:
        raise SandboxError(f"{reason}; and a canary job failed too: {e}") from e
    if check.status != "ok":
        raise SandboxError(f"{reason}; and a canary job got {check.status}: {check.detail}")
    return ended_by_job(job, out_of_memory=False)
