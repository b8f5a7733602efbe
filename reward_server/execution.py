"""The bounded execution queue: admission (429 beyond capacity) and the run slots.

A request reserves one slot per sandbox job it needs *before* any runs; if
the jobs already admitted plus its own exceed ``max_queued`` it is refused
with 429 and a ``Retry-After`` estimated from the recent job time. (A lone
request larger than the queue is admitted when nothing else is queued, so
no batch is refused forever.) Admitted jobs then wait for one of
``workers`` slots; a hostile program holds one slot for at most its wall
limit, so the others keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reward_server.sandbox.base import Job, RunOutcome, Sandbox, SandboxUnavailable
from services.app import ServiceError


class ExecQueue:
    def __init__(self, sandbox: Sandbox | None, *, workers: int, max_queued: int,
                 registry: CollectorRegistry, why_no_sandbox: str = "") -> None:
        self.sandbox, self.workers, self.max_queued = sandbox, workers, max_queued
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
