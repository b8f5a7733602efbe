"""A tied head on the session's real vLLM engine (tiny Qwen3, ``tie_word_embeddings``): vLLM loads a version's
``lm_head.weight`` into the one tensor that is both its head and its input embedding, so a version whose head is
not its embedding (a LoRA merged into the head of a tied model) would be served as neither the learner's head nor
its embedding. Such a version is refused before the engine sees it; one whose head equals its embedding loads."""

from __future__ import annotations

import pytest

from rollout_server.engine import Sampling
from services import wire

pytestmark = pytest.mark.usefixtures("engine_left_serving")


async def test_a_version_whose_head_is_not_its_tied_embedding_is_refused(rollout_engine, weight_versions, tiny_model,
                                                                          hf_logprobs):
    import torch
    from safetensors.torch import load_file

    from rollout_server.transports import WeightLoadError
    from services.weightstore import write_version

    base = load_file(tiny_model / "model.safetensors")
    assert "lm_head.weight" not in base  # the tiny Qwen3 ties its head: its checkpoint has none
    embed = base["model.embed_tokens.weight"]
    merged = embed + 0.5 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(0))
    before = rollout_engine.version
    v = weight_versions.next_version()
    bad = write_version(weight_versions.root / "tied-head", v, {**base, "lm_head.weight": merged})
    with pytest.raises(WeightLoadError, match="lm_head.weight unlike") as e:
        await rollout_engine.load_weights(wire.LoadWeights(version=v, uri=bad.path.as_uri(), sha256=bad.sha256))
    assert e.value.status == 422 and rollout_engine.version == before

    # the same head as the embedding is a harmless copy: loaded, and the engine serves exactly those weights
    v = weight_versions.next_version()
    good = write_version(weight_versions.root / "tied-copy", v, {**base, "lm_head.weight": embed.clone()})
    weight_versions.dirs[v] = good.path
    await rollout_engine.load_weights(wire.LoadWeights(version=v, uri=good.path.as_uri(), sha256=good.sha256))
    assert rollout_engine.version == v
    out = (await rollout_engine.generate([10, 11, 12], Sampling(max_tokens=8, seed=1))).samples[0]
    ref = hf_logprobs(tiny_model, [10, 11, 12], out.token_ids)  # the base model's own weights
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 2e-3
