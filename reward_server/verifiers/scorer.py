"""Dispatch a spec to its verifier; ``combined`` specs are weighted sums of their parts.

A combined score is infrastructure-failed if any part is (no partial
rewards are ever trained on); otherwise its reward is ``sum(w_i * r_i)``
and its status is the first part's status (the primary criterion first,
e.g. correctness before format), with every part's verdict in ``detail``.

Before anything in a batch is scored, every judge spec's ``url`` (combined
parts included) is checked against the judge's allow-list: one the server
will not call makes the whole request a 422 naming the field
(``items.3.spec.url``, ``items.0.spec.parts.1.spec.url``), which the rollout
side drops at once instead of retrying.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from reward_server.execution import ExecQueue
from reward_server.verifiers import code, text
from reward_server.verifiers.judge import Judge, UrlRefused
from reward_server.verifiers.math import MathVerifier
from reward_server.verifiers.result import infra, scored
from services.app import ServiceError
from services.reward_specs import (
    CombinedSpec,
    ExactSpec,
    JudgeSpec,
    MathSpec,
    NumericSpec,
    PythonTestsSpec,
    RegexSpec,
    RewardSpec,
)
from services.wire import ScoreItem, ScoreResult


def sandbox_jobs(spec: RewardSpec) -> int:
    """How many sandbox jobs scoring ``spec`` takes (for admission)."""
    if isinstance(spec, PythonTestsSpec):
        return 1
    if isinstance(spec, CombinedSpec):
        return sum(sandbox_jobs(p.spec) for p in spec.parts)
    return 0


def judge_urls(spec: RewardSpec, where: str) -> list[tuple[str, str]]:
    """``(field path, url)`` of every judge spec in ``spec`` that names a url."""
    if isinstance(spec, JudgeSpec):
        return [(f"{where}.url", spec.url)] if spec.url is not None else []
    if isinstance(spec, CombinedSpec):
        return [found for i, p in enumerate(spec.parts) for found in judge_urls(p.spec, f"{where}.parts.{i}.spec")]
    return []


class Scorer:
    def __init__(self, queue: ExecQueue, math: MathVerifier, judge: Judge, registry: CollectorRegistry, *,
                 regex_timeout_s: float = text.REGEX_TIMEOUT_S) -> None:
        self.queue, self.math, self.judge = queue, math, judge
        self.regex_timeout_s = regex_timeout_s
        self.m_scored = Counter("reward_scored", "Scored items by type and status", ["type", "status"],
                                registry=registry)

    def check(self, items: list[ScoreItem]) -> None:
        """Raise a 422 :class:`ServiceError` naming the first judge url the server will not call."""
        for i, item in enumerate(items):
            for field, url in judge_urls(item.spec, f"items.{i}.spec"):
                try:
                    self.judge.check_url(url)
                except UrlRefused as e:
                    loc = ["body", *(int(p) if p.isdigit() else p for p in field.split("."))]
                    raise ServiceError(422, f"{field}: {e}",
                                       errors=[{"loc": loc, "msg": str(e), "type": "url_refused"}]) from e

    async def score_all(self, items: list[ScoreItem]) -> list[ScoreResult]:
        self.check(items)
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
            return await text.regex(item_id, completion, spec, self.regex_timeout_s)
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
