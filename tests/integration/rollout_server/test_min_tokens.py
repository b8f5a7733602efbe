"""``sampling.min_tokens`` reaches vLLM through the actor: no completion ends before it, and the
behaviour log-probs of its held-back positions are the learner's.

Every character of the tiny model's alphabet is a stop string here, so without a minimum a
completion ends at its first visible token; with ``min_tokens = 6`` vLLM holds stop strings and
EOS back until the sixth token. Its sampler masks the end tokens there before it takes the log-probs;
the learner's recomputation (``learner.batch.collate`` + ``learner.logits.scored_logprobs``) masks the
same tokens at the same positions, so the two agree token for token.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from broker import Envelope, Stream, WeightRegistry
from broker.weight_versions import WeightVersion
from examples.tiny import DEFAULT_ALPHABET
from services import wire
from services.clients import RewardClient
from services.config import RunConfig
from services.reward_specs import RegexSpec
from tests.fixtures.rollout import TOKEN, version_spans

pytestmark = pytest.mark.usefixtures("engine_left_serving")

MIN_TOKENS = 6
TEMPERATURE = 0.8


async def test_the_actor_samples_at_least_min_tokens_with_the_learners_log_probs(
    rollout_engine, redis, keys, tiny_model, tmp_path, weight_versions, reward_service, learner_logprobs
):
    from rollout_server.actor import Actor

    train = tmp_path / "train.jsonl"
    train.write_text("")
    config = RunConfig.model_validate({
        "name": "min-tokens-test",
        "model": {"path": str(tiny_model), "max_model_len": 256},
        "data": {"train": str(train)},
        "sampling": {"group_size": 8, "max_tokens": 12, "min_tokens": MIN_TOKENS, "temperature": TEMPERATURE,
                     "stop": list(DEFAULT_ALPHABET)},
        "learner": {"groups_per_step": 1},
        "staleness": {"max_staleness": 1, "lease_s": 60, "visibility_timeout_s": 60},
    })
    req = weight_versions.make(seed=300, version=weight_versions.next_version())
    await WeightRegistry(redis, keys).publish(
        WeightVersion(version=req.version, uri=req.uri, sha256=req.sha256, created_at=time.time()))
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    gid = f"g-{uuid.uuid4().hex[:6]}"
    pg = wire.PromptGroup(run_id=keys.run_id, group_id=gid, prompt="2+3=", n=8, index=0, spec=RegexSpec(pattern="a"))
    await prompts.add_many([Envelope(gid, -1, wire.encode(pg))])
    traj = Stream.trajectories(redis, keys)
    await traj.ensure_group()

    reward = RewardClient(reward_service.url, TOKEN, attempts=2, max_total_s=10)
    actor = Actor(rollout_engine, redis=redis, keys=keys, config=config, reward=reward,
                  server_id=f"test-{keys.run_id}", metrics=rollout_engine.metrics, concurrency=2)
    task = asyncio.create_task(actor.run())
    try:
        got, deadline = [], time.monotonic() + 60
        while not got:
            assert time.monotonic() < deadline, "no trajectory group within 60 s"
            got = await traj.read("learner", count=1, block_ms=300)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reward.aclose()
    group = wire.decode(wire.TrajectoryGroup, got[0].envelope.payload)
    lengths = [len(s.token_ids) for s in group.samples]
    assert len(lengths) == 8 and min(lengths) >= MIN_TOKENS, lengths
    assert group.logprobs_mode == "processed_logprobs"
    held_gap = 0.0
    for s in group.samples:
        for start, stop, v in version_spans(s):  # the engine's version before the run's may begin a sample
            weights = weight_versions.dir_of(v)
            learner = learner_logprobs(weights, group.prompt_token_ids, s.token_ids, temperature=TEMPERATURE,
                                       min_tokens=MIN_TOKENS)[start:stop]
            assert max(abs(a - b) for a, b in zip(s.logprobs[start:stop], learner, strict=True)) < 2e-3, (
                s.logprobs, learner, s.token_versions)
            unmasked = learner_logprobs(weights, group.prompt_token_ids, s.token_ids, temperature=TEMPERATURE,
                                        min_tokens=0)[start:min(stop, MIN_TOKENS)]
            held_gap = max(held_gap, *(abs(a - b) for a, b in zip(s.logprobs[start:min(stop, MIN_TOKENS)], unmasked,
                                                                   strict=True)), 0.0)
    # the mask matters here: without it the recomputation is off by log(1 - P(EOS)) at the held positions
    assert held_gap > 5e-3, held_gap
