"""Dispatch a spec to its verifier; ``combined`` specs are weighted sums of their parts.

A combined score is infrastructure-failed if any part is (no partial
rewards are ever trained on); otherwise its reward is ``sum(w_i * r_i)``
and its status is the first part's status (the primary criterion first,
e.g. correctness before format), with every part's verdict in ``detail``.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from reward_server.execution import ExecQueue
from reward_server.verifiers import code, text
from reward_server.verifiers.judge import Judge
from reward_server.verifiers.math import MathVerifier
from reward_server.verifiers.result import infra, scored
from services.wire import (
    CombinedSpec,
    ExactSpec,
    JudgeSpec,
    MathSpec,
    NumericSpec,
    PythonTestsSpec,
    RegexSpec,
    RewardSpec,
    ScoreItem,
    ScoreResult,
)


def sandbox_jobs(spec: RewardSpec) -> int:
    """How many sandbox jobs scoring ``spec`` takes (for admission)."""
    if isinstance(spec, PythonTestsSpec):
        return 1
    if isinstance(spec, CombinedSpec):
        return sum(sandbox_jobs(p.spec) for p in spec.parts)
    return 0


class Scorer:
    def __init__(self, queue: ExecQueue, math: MathVerifier, judge: Judge, registry: CollectorRegistry) -> None:
        self.queue, self.math, self.judge = queue, math, judge
        self.m_scored = Counter("reward_scored", "Scored items by type and status", ["type", "status"],
                                registry=registry)

    async def score_all(self, items: list[ScoreItem]) -> list[ScoreResult]:
        results = await asyncio.gather(*(self.score(i.id, i.completion, i.spec) for i in items))
        for item, result in zip(items, results, strict=True):
            self.m_scored.labels(item.spec.type, result.status).inc()
        return list(results)

    async def score(self, item_id: str, completion: str, spec: RewardSpec) -> ScoreResult:
        if isinstance(spec, MathSpec):
            return await self.math.score(item_id, completion, spec)
        if isinstance(spec, ExactSpec):
            return text.exact(item_id, completion, spec)
        if isinstance(spec, NumericSpec):
            return text.numeric(item_id, completion, spec)
        if isinstance(spec, RegexSpec):
            return text.regex(item_id, completion, spec)
        if isinstance(spec, PythonTestsSpec):
            python = self.queue.sandbox.python if self.queue.sandbox else "python3"
            return await code.score(item_id, completion, spec, self.queue.run, python)
        if isinstance(spec, JudgeSpec):
            return await self.judge.score(item_id, completion, spec)
        if isinstance(spec, CombinedSpec):
            return await self.combined(item_id, completion, spec)
        raise TypeError(f"no verifier for {type(spec).__name__}")  # the wire union and this list disagree

    async def combined(self, item_id: str, completion: str, spec: CombinedSpec) -> ScoreResult:
        parts = await asyncio.gather(*(self.score(item_id, completion, p.spec) for p in spec.parts))
        detail = "; ".join(f"{p.spec.type}={r.status}" + (f"({r.detail})" if r.detail else "")
                           for p, r in zip(spec.parts, parts, strict=True))
        failed = next((r for r in parts if r.reward is None), None)
        if failed is not None:
            return infra(item_id, failed.status, detail)
        reward = sum(p.weight * (r.reward or 0.0) for p, r in zip(spec.parts, parts, strict=True))
        return scored(item_id, reward, parts[0].status, detail)
