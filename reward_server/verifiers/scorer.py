"""Dispatch a spec to its verifier; ``combined`` specs are weighted sums of their parts.

A combined score is infrastructure-failed if any part is (no partial
rewards are ever trained on); otherwise its reward is ``sum(w_i * r_i)``
over the parts that gave a reward (a python function's ``None`` gives none,
as in TRL's weighted sum) and its status is the first such part's status
(the primary criterion first, e.g. correctness before format), with every
part's verdict in ``detail``. A completion no part gave a reward gets 0
with status ``no_answer``.

Before anything in a batch is scored, every judge spec's ``url`` (combined
parts included) is checked against the judge's allow-list, and every python
spec's ``function`` against the reward-function allow-list (and looked up):
one the server will not call makes the whole request a 422 naming the field
(``items.3.spec.url``, ``items.0.spec.parts.1.spec.function``), which the
rollout side drops at once instead of retrying. Python specs are then scored
first, batched across the request (``reward_server.verifiers.functions``).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from reward_server.execution import ExecQueue
from reward_server.verifiers import code, text
from reward_server.verifiers.functions import Functions, Leaf, Scored, python_leaves
from reward_server.verifiers.judge import Judge, UrlRefused
from reward_server.verifiers.math import MathVerifier
from reward_server.verifiers.result import infra, scored
from reward_server.verifiers.reward_models import ModelLeaf, RewardModels
from services.app import ServiceError
from services.reward_specs import (
    CombinedSpec,
    ExactSpec,
    JudgeSpec,
    MathSpec,
    NumericSpec,
    PythonSpec,
    PythonTestsSpec,
    RegexSpec,
    RewardModelSpec,
    RewardSpec,
    leaves_of,
)
from services.wire import ScoreItem, ScoreResponse, ScoreResult, TrainerState


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


def _refused(field: str, msg: str, kind: str) -> ServiceError:
    loc = ["body", *(int(p) if p.isdigit() else p for p in field.split("."))]
    return ServiceError(422, f"{field}: {msg}", errors=[{"loc": loc, "msg": msg, "type": kind}])


class Scorer:
    def __init__(self, queue: ExecQueue, math: MathVerifier, judge: Judge, registry: CollectorRegistry, *,
                 functions: Functions | None = None, models: RewardModels | None = None,
                 regex_timeout_s: float = text.REGEX_TIMEOUT_S) -> None:
        self.queue, self.math, self.judge = queue, math, judge
        self.functions = functions if functions is not None else Functions([])
        self.models = models if models is not None else RewardModels({})
        self.regex_timeout_s = regex_timeout_s
        self.m_scored = Counter("reward_scored", "Scored items by type and status", ["type", "status"],
                                registry=registry)

    async def check(self, items: list[ScoreItem]) -> None:
        """Raise a 422 :class:`ServiceError` naming the first judge url, reward model or python function the server
        will not call (a function with a required parameter the spec's fields and args do not give is one)."""
        for i, item in enumerate(items):
            for field, url in judge_urls(item.spec, f"items.{i}.spec"):
                try:
                    self.judge.check_url(url)
                except UrlRefused as e:
                    raise _refused(field, str(e), "url_refused") from e
        for i, item in enumerate(items):
            for where, spec in leaves_of(item.spec, f"items.{i}.spec", RewardModelSpec):
                if (why := self.models.refusal(spec.model)) is not None:
                    raise _refused(f"{where}.model", why, "model_refused")
        leaves = [(i, where, spec) for i, item in enumerate(items)
                  for where, spec in python_leaves(item.spec, f"items.{i}.spec")]
        for _i, where, spec in leaves:
            refused = await self.functions.check([spec.function], {spec.function: [*spec.kwargs, *spec.args]})
            if spec.function in refused:
                raise _refused(f"{where}.function", refused[spec.function], "function_refused")

    async def score_all(self, items: list[ScoreItem], trainer_state: TrainerState | None = None) -> ScoreResponse:
        await self.check(items)

        def prompt(item: ScoreItem) -> str | list[dict]:
            return item.prompt if item.messages is None else [m.model_dump() for m in item.messages]

        scoring, modelled = await asyncio.gather(
            self.functions.score([
                Leaf(where, item.id, prompt(item), item.completion, spec, item.completion_ids)
                for i, item in enumerate(items) for where, spec in python_leaves(item.spec, f"items.{i}.spec")],
                None if trainer_state is None else trainer_state.model_dump()),
            self.models.score([
                ModelLeaf(where, item.id, prompt(item), item.completion, spec)
                for i, item in enumerate(items)
                for where, spec in leaves_of(item.spec, f"items.{i}.spec", RewardModelSpec)]))
        done = scoring.verdicts | modelled
        results = await asyncio.gather(*(self._top(item.id, item.completion, item.spec, f"items.{i}.spec", done)
                                         for i, item in enumerate(items)))
        for item, result in zip(items, results, strict=True):
            self.m_scored.labels(item.spec.type, result.status).inc()
        return ScoreResponse(
            results=[r.model_copy(update={"logged": scoring.logged[r.id]}) if r.id in scoring.logged else r
                     for r in results],
            metrics={name: sum(values) / len(values) for name, values in scoring.metrics.items()})

    async def _top(self, item_id: str, completion: str, spec: RewardSpec, where: str,
                   done: dict[str, Scored]) -> ScoreResult:
        result = await self._score(item_id, completion, spec, where, done)
        if result is None:
            return scored(item_id, 0.0, "no_answer", "no reward: the reward function returned None for it")
        return result

    async def _score(self, item_id: str, completion: str, spec: RewardSpec, where: str,
                     done: dict[str, Scored]) -> Scored:
        if isinstance(spec, PythonSpec | RewardModelSpec):
            return done[where]
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
            return await self.combined(item_id, completion, spec, where, done)
        raise TypeError(f"no verifier for {type(spec).__name__}")  # the wire union and this list disagree

    async def combined(self, item_id: str, completion: str, spec: CombinedSpec, where: str,
                       done: dict[str, Scored]) -> Scored:
        parts = await asyncio.gather(*(self._score(item_id, completion, p.spec, f"{where}.parts.{i}.spec", done)
                                       for i, p in enumerate(spec.parts)))
        detail = "; ".join(f"{p.spec.type}=" + ("none" if r is None else r.status + (f"({r.detail})" if r.detail else ""))
                           for p, r in zip(spec.parts, parts, strict=True))
        failed = next((r for r in parts if r is not None and r.reward is None), None)
        if failed is not None:
            return infra(item_id, failed.status, detail)
        given = [(p.weight, r) for p, r in zip(spec.parts, parts, strict=True) if r is not None]
        if not given:
            return None
        components = {name: value for _, r in given for name, value in r.components.items()}
        return scored(item_id, sum(w * r.reward for w, r in given), given[0][1].status, detail, components=components)
