"""Held-out evaluation: which versions are evaluated, the prompts, batched scoring, one point per version.

Who talks to whom:

- the control plane, when a run is created with an ``eval_prompt_set_id``, turns that prompt set
  into :class:`~services.wire.EvalPrompt` entries (:func:`eval_prompts`: specs completed from the
  run config, no format bonus, at most ``eval.max_prompts``) and stores them in the run's Redis
  keys (:meth:`EvalLog.store_prompts`) before the run becomes visible;
- each rollout server's actor evaluates the versions :func:`due` names (version 0 when
  ``eval.before``, then every ``eval.every`` published versions) right after it loads one, on its
  own engine; with several rollout servers the first to :meth:`EvalLog.claim` a version does it;
- the learner, once it has trained a run's last step (``eval.after``), asks for its final version
  (:meth:`EvalLog.request`), whether or not ``eval.every`` names it, and marks the run finished once
  a rollout server evaluated it the same way: a run started by ``tandem submit`` gets its final
  evaluation as one started by ``tandem run`` does, and a finished run's status holds it;
- :func:`evaluate` measures the version a rollout server serves over HTTP (``bench``, tests).

Every result goes through :meth:`EvalLog.record`: the run's ``"eval"`` metric point (step = the
version, ``accuracy``, ``count``) is appended at most once per version, whoever records it, in the
same atomic step that stores the result, so the dashboard, ``tandem status`` and the report see
one point per version.

An evaluation's prompts are all sent to the engine at once (vLLM batches them with whatever else
is in flight) and its completions scored in as few ``POST /v1/score`` calls as
:data:`SCORE_BATCH` allows. A completion counts as correct when its reward is 1. Each sample
carries the policy version that produced it, so a result states which weights were evaluated.

A held-out line with an ``episode`` (``services.wire.EpisodeSpec``) is evaluated as training runs it:
each completion is an episode with the line's tools (``rollout_server.episodes``, the eval sampling) and
the spec scores the model's last turn: on the actor's engine, and over HTTP (:func:`evaluate`) by sending
the line's ``episode`` with ``/v1/generate``, whose answer then holds each sample's last turn
(``GenerateResponse.last_turns``).

Samples per prompt (``eval.samples = n``, ``eval.temperature``): by default one greedy completion,
and ``accuracy`` is the fraction of prompts answered correctly. With ``n > 1`` each prompt gets
``n`` sampled completions; ``accuracy`` is then mean@n (the fraction of all completions that
are correct: the expected accuracy of one sample) and ``pass_at[k]`` is pass@k for the ``k`` of
:func:`pass_ks`, with Chen et al.'s unbiased estimator (:func:`pass_at_k`, "Evaluating Large
Language Models Trained on Code", 2021, https://arxiv.org/abs/2107.03374): the chance that at
least one of ``k`` completions drawn from the ``n`` is correct, averaged over prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from broker import Keys
from services import wire
from services.clients import RewardClient, RolloutClient
from services.config import EvalConfig, RunConfig
from services.prompt_forms import chat_template_in, prompt_forms
from services.prompt_lines import LineParser, line_specs
from services.runs import MetricsLog

SCORE_BATCH = 1024
"""Completions per ``POST /v1/score`` (the wire type allows 4096 items; this keeps a body of long
completions well under the reward server's request-size cap)."""
HTTP_CONCURRENCY = 256
"""Prompts :func:`evaluate` keeps in flight over HTTP (below the rollout server's ``max_pending_seqs``)."""


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    """Fraction of completions that are correct (mean@n; with one greedy sample, of prompts)."""
    mean_reward: float
    """Mean reward of the completions scored (a reward model's held-out score; accuracy counts rewards of 1)."""
    count: int
    """Prompts evaluated."""
    versions: frozenset[int]
    infra_failures: int
    samples: int = 1
    """Completions per prompt (``eval.samples``)."""
    pass_at: dict[int, float] = field(default_factory=dict)
    """k -> pass@k for each k of :func:`pass_ks` (empty with one sample per prompt)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` completions correct (Chen et al. 2021, eq. 1):
    ``1 - C(n-c, k) / C(n, k)``, the chance that ``k`` completions drawn without replacement from the
    ``n`` include a correct one. Computed as a product, which stays exact in floating point where
    the binomials would overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    missed = 1.0
    for i in range(n - c + 1, n + 1):
        missed *= 1.0 - k / i
    return 1.0 - missed


def pass_ks(samples: int) -> list[int]:
    """The k whose pass@k an evaluation with ``samples`` completions per prompt reports: the powers
    of two below ``samples``, and ``samples`` itself; none for a single sample."""
    if samples < 2:
        return []
    return sorted({1 << i for i in range(samples.bit_length()) if 1 << i < samples} | {samples})


def due(version: int, cfg: EvalConfig) -> bool:
    """Whether a rollout server that has just loaded ``version`` evaluates it: version 0 (the
    initial policy) when ``eval.before``, then every ``eval.every``-th version."""
    if version == 0:
        return cfg.before
    return cfg.every > 0 and version % cfg.every == 0


def eval_prompts(lines: list[dict], config: RunConfig, chat: bool | None = None) -> list[wire.EvalPrompt]:
    """The held-out prompts of stored prompt-set ``lines`` under ``config`` (at most
    ``eval.max_prompts``); raises ``services.prompt_lines.LineError``. No format bonus: a
    completion is correct when the task's own spec scores it 1."""
    lines = lines[: config.eval.max_prompts]
    plain = config.model_copy(update={"reward": config.reward.model_copy(update={"format_weight": 0.0})})
    forms = prompt_forms(lines, config, chat)  # as the training set's (services.prompt_forms); chat: the model's template
    return [wire.EvalPrompt(**form.wire_fields(), spec=spec, episode=line.get("episode"))
            for form, spec, line in zip(forms, line_specs(lines, plain), lines, strict=True)]


def load_eval_set(path: Path, config: RunConfig, limit: int | None) -> list[wire.EvalPrompt]:
    """The held-out prompts of a local file, as :func:`eval_prompts` builds them (whether the model has a
    chat template read from ``model.path``)."""
    parser = LineParser(config.reward.type)
    parser.feed(path.read_bytes())
    lines = parser.finish()[:limit]
    return eval_prompts(lines, config, chat_template_in(config.model.path))


def _generate_fields(prompt: wire.EvalPrompt, config: RunConfig) -> dict:
    """The ``prompt`` or ``messages`` (with the run's chat-template variables) of a ``GenerateRequest``."""
    if prompt.messages is not None:
        return {"messages": prompt.messages, "chat_template_kwargs": config.prompt.chat_template_kwargs}
    return {"prompt": prompt.prompt}


class EvalLog:
    """One run's held-out prompts, claims and results in Redis (keys ``eval_prompts``, ``evals``)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def store_prompts(self, prompts: list[wire.EvalPrompt]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.eval_prompts)
            if prompts:
                pipe.rpush(self.keys.eval_prompts, *[wire.encode(p) for p in prompts])
            await pipe.execute()

    async def prompts(self) -> list[wire.EvalPrompt]:
        return [wire.decode(wire.EvalPrompt, raw) for raw in await self.redis.lrange(self.keys.eval_prompts, 0, -1)]

    async def request(self, version: int) -> None:
        """Ask the rollout servers to evaluate ``version`` although :func:`due` does not name it (the final one)."""
        await self.redis.hset(self.keys.evals, f"request:{version}", "1")

    async def requested(self) -> set[int]:
        """The versions :meth:`request` asked for."""
        return {int(k[8:]) for k in (k.decode() for k in await self.redis.hkeys(self.keys.evals))
                if k.startswith("request:")}

    async def claim(self, version: int, who: str) -> bool:
        """True for the first caller only: it evaluates ``version``."""
        return bool(await self.redis.hsetnx(self.keys.evals, f"claim:{version}", who))

    async def record(self, version: int, result: EvalResult, who: str) -> bool:
        """Store ``result`` as ``version``'s and append its ``"eval"`` metric point, atomically and only if
        no result of ``version`` was recorded before; True if this call recorded it. The point holds
        ``accuracy``, ``count``, ``held_out_reward`` (the completions' mean reward) and, with several samples per
        prompt, ``samples``, ``pass_at_<k>`` and ``pass_at_n`` (k = samples)."""
        point = wire.EvalPoint(version=version, accuracy=result.accuracy, count=result.count, by=who,
                               samples=result.samples, pass_at=result.pass_at, reward_mean=result.mean_reward)
        more = {f"pass_at_{k}": v for k, v in result.pass_at.items()} | {"held_out_reward": result.mean_reward}
        if result.samples > 1:  # pass_at_n: one name for the charts, whatever n is
            more |= {"samples": result.samples, "pass_at_n": result.pass_at[result.samples]}
        entry = await MetricsLog(self.redis, self.keys).append_once(
            (self.keys.evals, f"point:{version}", point.model_dump_json()),
            "eval", version, accuracy=result.accuracy, count=result.count, **more,
        )
        return entry is not None

    async def points(self) -> dict[int, wire.EvalPoint]:
        """Every recorded result, by version."""
        raw = await self.redis.hgetall(self.keys.evals)
        return {int(k[6:]): wire.EvalPoint.model_validate_json(v)
                for k, v in ((k.decode(), v) for k, v in raw.items()) if k.startswith("point:")}


async def score(reward: RewardClient, prompts: list[wire.EvalPrompt], texts: list[list[str]],
                versions: list[int], token_ids: list[list[list[int]] | None] | None = None) -> EvalResult:
    """Score ``texts`` (``texts[i]``: the completions of ``prompts[i]``, as many for each prompt,
    generated by ``versions``; ``token_ids[i]`` their sampled token ids, None where not generated) in
    :data:`SCORE_BATCH`-sized calls; an item the reward server could not score counts as wrong and in
    ``infra_failures``."""
    samples = len(texts[0]) if texts else 1
    if any(len(t) != samples for t in texts) or len(texts) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts need {samples} completions each")
    ids = token_ids or [None] * len(prompts)
    items = [wire.ScoreItem(id=f"{i}:{j}", prompt=prompts[i].prompt or "", messages=prompts[i].messages,
                            completion=text, completion_ids=None if ids[i] is None else ids[i][j], spec=prompts[i].spec)
             for i in range(len(prompts)) for j, text in enumerate(texts[i])]
    results: list[wire.ScoreResult] = []
    for start in range(0, len(items), SCORE_BATCH):
        results += (await reward.score(wire.ScoreRequest(items=items[start:start + SCORE_BATCH]))).results
    scored = [r for r in results if r.reward is not None]
    correct = [0] * len(prompts)
    for item, r in zip(items, results, strict=True):
        if r.reward is not None and r.reward >= 1.0 - 1e-9:
            correct[int(item.id.split(":")[0])] += 1
    n = len(prompts)
    return EvalResult(
        accuracy=sum(correct) / (n * samples) if n else 0.0,
        mean_reward=sum(r.reward for r in scored) / len(scored) if scored else 0.0,
        count=n,
        versions=frozenset(versions),
        infra_failures=len(results) - len(scored),
        samples=samples,
        pass_at={k: sum(pass_at_k(samples, c, k) for c in correct) / n if n else 0.0 for k in pass_ks(samples)},
    )


async def evaluate(
    rollout: RolloutClient,
    reward: RewardClient,
    items: list[tuple[str, object]] | list[wire.EvalPrompt],
    config: RunConfig,
    *,
    concurrency: int = HTTP_CONCURRENCY,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Evaluate the version a rollout server serves, over HTTP: every prompt's ``/v1/generate`` in
    flight at once (up to ``concurrency``), then batched scoring. A prompt with an ``episode`` is sent with
    it (the rollout server runs the episodes with its tools) and its samples' last turns are scored."""
    prompts = [p if isinstance(p, wire.EvalPrompt) else wire.EvalPrompt(prompt=p[0], spec=p[1]) for p in items]
    limit = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int, prompt: wire.EvalPrompt) -> wire.GenerateResponse:
        nonlocal done
        async with limit:
            out = await rollout.generate(wire.GenerateRequest(
                **_generate_fields(prompt, config), n=config.eval.samples, temperature=config.eval.temperature,
                max_tokens=config.sampling.max_tokens, stop=config.sampling.stop, seed=i, episode=prompt.episode,
            ))
        done += 1
        if progress is not None:
            progress(done)
        return out

    outs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    texts = [out.last_turns if out.last_turns is not None else [s.text for s in out.samples] for out in outs]
    return await score(reward, prompts, texts, [s.policy_version for out in outs for s in out.samples],
                       [[s.token_ids for s in out.samples] for out in outs])
