"""LoRA adapters served by vLLM (``rollout_server.adapters``): a rollout engine started for adapters
(``lora_rank``) loads each weight version as a PEFT adapter the learner wrote, generates with it, and
replaces it with the next one.

The adapters come from the learner's own code path: ``tests.selfcheck`` trains the tiny model's LoRA
for one and for two steps with ``publish.lora_format = "adapter"`` and writes, for each, the version
``learner.publisher.publish_tensors`` publishes (a PEFT adapter, through ``services.weightstore``) and
the full weights with the adapter merged in (``LearnerEngine.full_state_dict``: what ``"merged"``
publishes). A sample's log-probs under the adapter must equal Hugging Face's under the merged
weights of the same version within the tolerance the other reload tests use (2e-3), and differ
from the base model's by far more. One engine start of its own (LoRA must be enabled when vLLM
starts) and one learner run, about a minute each on 2 CPU cores."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.fixtures.learner import LORA_OVERRIDES, run_selfcheck
from tests.fixtures.rollout import MAX_MODEL_LEN

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

ATOL = 2e-3
"""vLLM (CPU, float32) against Hugging Face on the same weights: the tolerance of test_http's reloads."""
PROMPT_IDS = [10, 11, 12, 13]


class Version:
    """One trained LoRA state: its PEFT adapter directory and a directory of its merged full weights."""

    def __init__(self, adapter: Path, merged: Path) -> None:
        self.adapter, self.merged = adapter, merged


@pytest.fixture(scope="module")
def lora_states(tiny_model, tmp_path_factory) -> dict[int, Version]:
    """``{1: after one step, 2: after two steps}``, written by the learner's publish path."""
    work = tmp_path_factory.mktemp("lora-adapter")
    plan = [{"name": f"lora{steps}", "stage": 2, "steps": steps, "overrides": LORA_OVERRIDES} for steps in (1, 2)]
    outs = run_selfcheck(tiny_model, plan, work)
    states = {}
    for steps in (1, 2):
        merged = work / f"merged{steps}"
        merged.mkdir()
        shutil.copy(outs[f"lora{steps}"], merged / "model.safetensors")
        (adapter,) = (work / f"lora{steps}-adapter").iterdir()
        states[steps] = Version(adapter, merged)
    return states


@pytest.fixture(scope="module")
async def lora_engine(tiny_model):
    """A vLLM engine on the tiny model with LoRA enabled for the run's rank (4: max_lora_rank 8) on the
    run's target modules (q_proj, v_proj: vLLM's fused qkv_proj)."""
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    lora = LORA_OVERRIDES["learner"]["lora"]
    engine = await RolloutEngine.start(
        tiny_model, RolloutSettings(kv_cache_gib=0.25, enforce_eager=True, seed=0),
        metrics=RolloutMetrics(CollectorRegistry()), max_model_len=MAX_MODEL_LEN, dtype="float32",
        lora_rank=lora["r"], lora_targets=lora["target_modules"],
    )
    yield engine
    engine.shutdown()


def _load(version: int, path: Path):
    from services.weightstore import digest
    from services.wire import LoadWeights

    return LoadWeights(version=version, uri=path.as_uri(), sha256=digest(path))


async def _samples(engine, *, seed: int, n: int = 4, max_tokens: int = 24):
    from rollout_server.engine import Sampling

    gen = await engine.generate(PROMPT_IDS, Sampling(n=n, max_tokens=max_tokens, seed=seed), source="test")
    return gen.samples


def _gap(hf_logprobs, weights: Path, sample) -> float:
    ref = hf_logprobs(weights, PROMPT_IDS, sample.token_ids)
    return max(abs(a - b) for a, b in zip(sample.logprobs, ref, strict=True))


async def test_adapter_version_generates_as_its_merged_weights(lora_engine, lora_states, hf_logprobs, tiny_model):
    status = await lora_engine.load_weights(_load(1, lora_states[1].adapter))
    assert status.version == 1 and lora_engine.adapters.serving.version == 1
    assert len(await lora_engine.llm.list_loras()) == 1
    samples = await _samples(lora_engine, seed=1)
    assert all(s.policy_version == 1 and s.token_ids for s in samples)
    for s in samples:
        assert _gap(hf_logprobs, lora_states[1].merged, s) < ATOL, "the adapter's log-probs are not the merged weights'"
    # the adapter is really applied: the base model gives these tokens other log-probs
    assert max(_gap(hf_logprobs, tiny_model, s) for s in samples) > 10 * ATOL


async def test_next_version_replaces_the_adapter(lora_engine, lora_states, hf_logprobs, tiny_model):
    await lora_engine.load_weights(_load(1, lora_states[1].adapter))  # a no-op after the test above
    first = lora_engine.adapters.serving.lora.lora_int_id
    status = await lora_engine.load_weights(_load(2, lora_states[2].adapter))
    assert status.version == 2
    serving = lora_engine.adapters.serving
    assert serving.version == 2 and serving.lora.lora_int_id != first
    assert set(await lora_engine.llm.list_loras()) == {serving.lora.lora_int_id}, "the previous adapter was not removed"
    samples = await _samples(lora_engine, seed=2)
    for s in samples:
        assert s.policy_version == 2
        assert _gap(hf_logprobs, lora_states[2].merged, s) < ATOL
    # the two versions differ by more than the tolerance, so the check above tells them apart
    assert max(_gap(hf_logprobs, lora_states[1].merged, s) for s in samples) > 2 * ATOL

    await lora_engine.reset_to_base()  # version 0: no adapter at all
    assert lora_engine.version == 0 and not await lora_engine.llm.list_loras()
    for s in await _samples(lora_engine, seed=3):
        assert s.policy_version == 0 and _gap(hf_logprobs, tiny_model, s) < ATOL


async def test_full_weights_refused_and_adapter_kept(lora_engine, lora_states):
    from rollout_server.transports import WeightLoadError

    await lora_engine.load_weights(_load(3, lora_states[1].adapter))
    with pytest.raises(WeightLoadError, match="not a PEFT adapter") as e:
        await lora_engine.load_weights(_load(4, lora_states[1].merged))
    assert e.value.status == 422
    assert lora_engine.version == 3 and lora_engine.adapters.serving.version == 3
    assert all(s.policy_version == 3 for s in await _samples(lora_engine, seed=4, n=1, max_tokens=4))


async def test_requests_around_a_swap_are_tagged_with_the_adapter_that_sampled_them(
        lora_engine, lora_states, hf_logprobs):
    """A reload lands while one generate call is in flight and another arrives: every sample's tag
    names the weights its log-probs come from (the in-flight one finishes on the old adapter; the one
    arriving during the swap waits for the new adapter)."""
    await lora_engine.load_weights(_load(5, lora_states[1].adapter))
    merged = {5: lora_states[1].merged, 6: lora_states[2].merged}
    before = asyncio.create_task(_samples(lora_engine, seed=5, n=4, max_tokens=64))
    await asyncio.sleep(0.2)
    reload = asyncio.create_task(lora_engine.load_weights(_load(6, lora_states[2].adapter)))
    await asyncio.sleep(0)
    during = asyncio.create_task(_samples(lora_engine, seed=6, n=4, max_tokens=16))
    samples = [*await before, *await during]
    assert (await reload).version == 6
    assert {s.policy_version for s in samples} <= {5, 6}
    for s in samples:
        assert _gap(hf_logprobs, merged[s.policy_version], s) < ATOL, f"sample tagged {s.policy_version}"
    after = await _samples(lora_engine, seed=7, n=2, max_tokens=8)
    assert all(s.policy_version == 6 for s in after)
