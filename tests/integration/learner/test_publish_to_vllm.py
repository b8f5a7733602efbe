"""Publish -> the real rollout server (vLLM) loads the version -> its log-probs equal the learner's.

The learner side: two ZeRO-3 steps of the DeepSpeed engine on the session's
tiny model (``tests.selfcheck``, shared with the engine tests), the
log-probs of a fixed sequence from that engine, and the gathered weights
written by the publisher's writer (``services.weightstore.write_version``).
The chain checked: DeepSpeed engine log-probs == Hugging Face on the
published files == the rollout server's sample log-probs after
``POST /v1/weights`` (session vLLM engine from ``tests/fixtures/rollout.py``).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


async def test_rollout_server_loads_a_published_version(one_rank_runs, rollout_server, weight_versions, hf_logprobs,
                                                        tmp_path):
    """Through the real rollout server (session vLLM engine, tied tiny model): the learner's version,
    written in the server's weight store (``<run dir>/<run>/weights``) and registered as the learner
    publishes it, loads by POST /v1/weights; then its samples' log-probs equal the learner's."""
    import httpx
    from safetensors.torch import load_file

    from services import weightstore as store

    run = one_rank_runs["zero3"]  # two ZeRO-3 steps on the session's tiny model; weights gathered
    report = json.loads(run.with_name(run.name + ".json").read_text())
    version = weight_versions.next_version()
    weights = weight_versions.root / f"learner-{tmp_path.name}" / "weights"  # learner.trainer.Paths' layout
    written = store.write_version(weights, version, load_file(run), step=2)
    weight_versions.register(version, written.path, written.sha256)  # as the learner's registry.publish
    weight_versions.dirs[version] = written.path  # the shared engine serves it from now on: later tests look it up
    # the learner's own (DeepSpeed) log-probs of a fixed sequence are what its published weights give
    probe = report["probe"]
    assert hf_logprobs(written.path, probe[:1], probe[1:]) == pytest.approx(report["probe_logprobs"], abs=2e-4)

    async with httpx.AsyncClient(base_url=rollout_server.url, headers=rollout_server.headers, timeout=120) as http:
        r = await http.post("/v1/weights", json={"version": version, "uri": written.path.as_uri(),
                                                 "sha256": written.sha256})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == version
        prompt = probe[:4]
        r = await http.post("/v1/generate", json={"prompt_token_ids": prompt, "n": 2, "max_tokens": 8,
                                                  "temperature": 1.0, "seed": 0})
        assert r.status_code == 200, r.text
    samples = r.json()["samples"]
    for s in samples:
        assert s["policy_version"] == version
        assert s["logprobs"] == pytest.approx(hf_logprobs(written.path, prompt, s["token_ids"]), abs=2e-4)
