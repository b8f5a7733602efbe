"""The bounded execution queue: admission (429 beyond capacity) and the run slots.

A request reserves one slot per sandbox job it needs *before* any runs; if
the jobs already admitted plus its own exceed ``max_queued`` it is refused
with 429 and a ``Retry-After`` estimated from the recent job time. (A lone
request larger than the queue is admitted when nothing else is queued, so
no batch is refused forever.) Admitted jobs then wait for one of
``workers`` slots; a hostile program holds one slot for at most its wall
limit, so the others keep flowing.

Limits are client-supplied (a prompt-set line or an ``/v1/execute`` body
chooses them, and prompt-set authors are not trusted), so the server holds
ceilings (``max_*`` in :class:`~reward_server.settings.RewardSettings`):
the HTTP edge refuses a request over one with 422 naming the field
(:func:`over_ceilings`), and :meth:`ExecQueue.run` clamps every job to them
as well, whichever path it came by.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reward_server.sandbox.base import Job, RunOutcome, Sandbox, SandboxUnavailable
from services.app import ServiceError
from services.reward_specs import CombinedSpec, Limits, PythonTestsSpec, RewardSpec

# Limits field -> the RewardSettings field that caps it.
CEILINGS = {"wall_s": "max_wall_s", "cpu_s": "max_cpu_s", "memory_mb": "max_memory_mb",
            "processes": "max_processes", "output_bytes": "max_output_bytes", "file_bytes": "max_file_bytes"}


def ceilings_of(settings: object) -> dict[str, float]:
    """Limits field -> the server's ceiling for it, from a RewardSettings."""
    return {name: getattr(settings, setting) for name, setting in CEILINGS.items()}


def over_ceilings(limits: Limits, ceilings: Mapping[str, float], where: str) -> list[str]:
    """One message per field of ``limits`` above its ceiling, each naming the field (``where.limits.x``)."""
    return [f"{where}.{name}: {getattr(limits, name)} is above this server's ceiling {CEILINGS[name]} = {ceiling}"
            for name, ceiling in ceilings.items() if getattr(limits, name) > ceiling]


def spec_limits(spec: RewardSpec, where: str) -> Iterator[tuple[str, Limits]]:
    """Every ``limits`` inside a reward spec, with its dotted path."""
    if isinstance(spec, PythonTestsSpec):
        yield f"{where}.limits", spec.limits
    elif isinstance(spec, CombinedSpec):
        for i, part in enumerate(spec.parts):
            yield from spec_limits(part.spec, f"{where}.parts.{i}.spec")


def refuse_over_ceilings(found: Iterator[tuple[str, Limits]], ceilings: Mapping[str, float]) -> None:
    """422 naming every field above its ceiling, or nothing."""
    problems = [p for where, limits in found for p in over_ceilings(limits, ceilings, where)]
    if problems:
        raise ServiceError(422, "; ".join(problems[:10]), errors=problems)


def clamp(job: Job, ceilings: Mapping[str, float]) -> Job:
    """``job`` with every limit at most its ceiling."""
    lower = {k: type(getattr(job.limits, k))(c) for k, c in ceilings.items() if getattr(job.limits, k) > c}
    return dataclasses.replace(job, limits=job.limits.model_copy(update=lower)) if lower else job


class ExecQueue:
    def __init__(self, sandbox: Sandbox | None, *, workers: int, max_queued: int,
                 registry: CollectorRegistry, why_no_sandbox: str = "",
                 ceilings: Mapping[str, float] | None = None) -> None:
        self.sandbox, self.workers, self.max_queued = sandbox, workers, max_queued
        self.ceilings = dict(ceilings or {})
        self.why_no_sandbox = why_no_sandbox
        self.admitted = 0
        self._slots = asyncio.Semaphore(workers)
        self._job_s = 0.5  # moving average of a job's time, for Retry-After
        self.m_pending = Gauge("reward_exec_admitted", "Sandbox jobs admitted and not finished", registry=registry)
        self.m_rejected = Counter("reward_exec_rejected", "Requests refused with 429", registry=registry)
        self.m_seconds = Histogram("reward_exec_seconds", "Sandbox job time", ["backend"], registry=registry,
                                   buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60))
        self.m_status = Counter("reward_exec_runs", "Program runs by verdict", ["status"], registry=registry)

    @contextlib.contextmanager
    def reserve(self, jobs: int) -> Iterator[None]:
        if jobs <= 0:
            yield
            return
        if self.admitted > 0 and self.admitted + jobs > self.max_queued:
            self.m_rejected.inc()
            wait = (self.admitted / self.workers) * self._job_s
            raise ServiceError(429, f"execution queue full ({self.admitted} jobs admitted)", retry_after=max(1.0, wait))
        self.admitted += jobs
        self.m_pending.set(self.admitted)
        try:
            yield
        finally:
            self.admitted -= jobs
            self.m_pending.set(self.admitted)

    async def run(self, job: Job) -> list[RunOutcome]:
        if self.sandbox is None:
            raise SandboxUnavailable(f"code execution is disabled: {self.why_no_sandbox}")
        job = clamp(job, self.ceilings)
        async with self._slots:
            start = time.monotonic()
            try:
                outcomes = await self.sandbox.run(job)
            finally:
                took = time.monotonic() - start
                self._job_s = 0.9 * self._job_s + 0.1 * took
                self.m_seconds.labels(self.sandbox.name).observe(took)
        for outcome in outcomes:
            self.m_status.labels(outcome.status).inc()
        return outcomes
