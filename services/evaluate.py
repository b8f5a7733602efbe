"""Held-out evaluation through the running services.

``tandem run`` measures accuracy before and after training the way a user
would: every held-out prompt goes to a rollout server's ``/v1/generate``
(greedy unless ``eval.temperature > 0``), every completion to the reward
server's ``/v1/score`` with the line's own reward spec (no format bonus). A
completion counts as correct when its reward is 1. Each sample carries the
policy version that produced it, so the caller can check which weights were
evaluated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services import wire
from services.clients import RewardClient, RolloutClient
from services.config import RunConfig
from services.promptsets import LineParser, line_specs


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    mean_reward: float
    count: int
    versions: frozenset[int]
    infra_failures: int


def load_eval_set(path: Path, config: RunConfig, limit: int | None) -> list[tuple[str, object]]:
    """(prompt, reward spec) of each held-out line, specs completed from the run config."""
    parser = LineParser(config.reward.type)
    parser.feed(path.read_bytes())
    lines = parser.finish()[:limit]
    plain = config.model_copy(update={"reward": config.reward.model_copy(update={"format_weight": 0.0})})
    return list(zip([ln["prompt"] for ln in lines], line_specs(lines, plain), strict=True))


async def evaluate(
    rollout: RolloutClient,
    reward: RewardClient,
    items: list[tuple[str, object]],
    config: RunConfig,
    *,
    concurrency: int = 32,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    limit = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int, prompt: str, spec) -> tuple[wire.ScoreResult, int]:
        nonlocal done
        async with limit:
            out = await rollout.generate(wire.GenerateRequest(
                prompt=prompt, n=1, temperature=config.eval.temperature, max_tokens=config.sampling.max_tokens,
                stop=config.sampling.stop, seed=i,
            ))
            sample = out.samples[0]
            scored = await reward.score(wire.ScoreRequest(items=[wire.ScoreItem(id=str(i), completion=sample.text, spec=spec)]))
        done += 1
        if progress is not None:
            progress(done)
        return scored.results[0], sample.policy_version

    results = await asyncio.gather(*[one(i, p, s) for i, (p, s) in enumerate(items)])
    scored = [r for r, _ in results if r.reward is not None]
    correct = sum(r.reward >= 1.0 - 1e-9 for r in scored)
    return EvalResult(
        accuracy=correct / len(items) if items else 0.0,
        mean_reward=sum(r.reward for r in scored) / len(scored) if scored else 0.0,
        count=len(items),
        versions=frozenset(v for _, v in results),
        infra_failures=len(results) - len(scored),
    )
