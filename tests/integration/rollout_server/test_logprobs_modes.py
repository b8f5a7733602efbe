"""Behaviour log-probs under top-k/top-p (docs/architecture.md section 3, "Behaviour log-probabilities"), checked against
Hugging Face logits truncated by hand the way vLLM's sampler truncates them.

Default mode (``processed_logprobs``), here on the session engine (tiny Qwen3): each token's
log-prob is of the distribution it was drawn from, ``log_softmax`` of ``logits / T`` after
top-k and top-p, renormalised over the kept tokens. ``raw_logprobs`` needs an engine of its
own: ``test_models.py`` starts its OLMo-3 server in that mode and uses :func:`expected`.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.wire import GenerateResponse

pytestmark = pytest.mark.usefixtures("engine_left_serving")

PROMPT_IDS = [10, 11, 12]
TRUNCATED = dict(temperature=0.7, top_k=5, top_p=0.8)
"""Sampling that truncates: with a random tiny model's flat distribution both cuts remove tokens."""


def truncate(logits, top_k: int, top_p: float):
    """``logits`` (one row per position) with the tokens vLLM's top-k then top-p drop set to -inf
    (``apply_top_k_top_p_pytorch``: top-k keeps logits >= the k-th largest; top-p sorts ascending and
    drops tokens whose cumulative probability is <= 1 - p, never the most likely one)."""

    out = logits.clone()
    if top_k > 0:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        ascending, index = out.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        out = out.scatter(-1, index, ascending.masked_fill(drop, float("-inf")))
    return out


def expected(logits, token_ids: list[int], mode: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Per completion token, the log-prob ``mode`` promises, from the logits at the positions that
    predict each token: ``processed_logprobs`` = log_softmax(truncate(logits / T)), ``raw_logprobs`` =
    log_softmax(logits)."""
    import torch

    if mode == "processed_logprobs":
        lp = torch.log_softmax(truncate(logits / temperature, top_k, top_p), dim=-1)
    else:
        lp = torch.log_softmax(logits, dim=-1)
    return [lp[i, t].item() for i, t in enumerate(token_ids)]


def completion_logits(model, prompt_ids: list[int], token_ids: list[int]):
    """The float32 logits at the positions that predict each completion token."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(token_ids)]


def _hf_model(base: Path, weights_dir: Path):
    """The tiny Qwen3 in float32 with the weights of ``weights_dir`` (a version's, or the base model's)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if Path(weights_dir) != Path(base):
        state = {}
        for f in sorted(Path(weights_dir).glob("*.safetensors")):
            state.update(load_file(f))
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    return model.eval()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_processed_logprobs_are_of_the_truncated_renormalised_distribution(
    rollout_server, weight_versions, tiny_model
):
    async with httpx.AsyncClient(base_url=rollout_server.url, headers=rollout_server.headers, timeout=120) as c:
        r = await c.post("/v1/generate", json=dict(prompt_token_ids=PROMPT_IDS, n=4, max_tokens=16, seed=5,
                                                    **TRUNCATED))
    assert r.status_code == 200, r.text
    out = GenerateResponse.model_validate(r.json())
    assert out.logprobs_mode == "processed_logprobs"
    models = {}
    for s in out.samples:
        weights = weight_versions.dir_of(s.policy_version)
        model = models.setdefault(weights, _hf_model(tiny_model, weights))
        logits = completion_logits(model, PROMPT_IDS, s.token_ids)
        kept = truncate(logits / TRUNCATED["temperature"], TRUNCATED["top_k"], TRUNCATED["top_p"])
        assert all(kept[i, t] > float("-inf") for i, t in enumerate(s.token_ids)), "sampled a truncated token"
        assert (kept.isfinite().sum(-1) < TRUNCATED["top_k"]).any(), "top-p cut nothing: the test is weak"
        processed = expected(logits, s.token_ids, "processed_logprobs", **TRUNCATED)
        assert gap(s.logprobs, processed) < 2e-3, (s.logprobs, processed)
        # neither the untruncated tempered distribution nor the raw one
        tempered = expected(logits, s.token_ids, "processed_logprobs", temperature=TRUNCATED["temperature"])
        assert gap(s.logprobs, tempered) > 1e-2
        assert gap(s.logprobs, expected(logits, s.token_ids, "raw_logprobs")) > 1e-2
