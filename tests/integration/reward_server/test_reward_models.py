"""``reward_model`` specs: a tiny sequence classifier built in code scores through ``POST /v1/score`` what TRL
1.16's ``GRPOTrainer._calculate_rewards`` gives with the same model (its chat template for conversational
lines, prompt + completion otherwise, right padding, ``logits[:, 0]``), alone and inside a ``combined`` spec;
a model the server does not list is refused naming the field; a line longer than ``model_max_tokens`` is a
``reward_error``, not a made-up reward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("trl")

PROMPT = [{"role": "user", "content": "What is 6 x 7?"}]
COMPLETIONS = ["<answer>42</answer>", "I think it is 41", "42", "forty-two, surely: <answer>42</answer>", ""]


@pytest.fixture(scope="module")
def reward_model(tiny_model, tmp_path_factory) -> Path:
    """A random one-label sequence classifier on the tiny Qwen3 and its char tokenizer (with a chat template),
    its score head saved with it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("models") / "tiny-rm"
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def trls_own(path: Path, prompts: list, completions: list) -> list[float]:
    """TRL's scoring with a model (``_calculate_rewards``, ``reward_funcs`` holding a model), step by step."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl.data_utils import apply_chat_template, is_conversational

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    if is_conversational({"prompt": prompts[0]}):
        texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(prompts, completions,
                                                                                              strict=True)]
    else:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].tolist()


async def in_a_thread(folder: str, pairs: list, batch_size: int, max_tokens: int) -> list:
    """A ``models_runner`` that scores in a thread of this process, the models loaded on the CPU and then "moved"
    (on Modal the runner is a call of the memory-snapshotted container: ``deploy.modal_app._run_reward_model``)."""
    from reward_server.verifiers.reward_models import _load, move_loaded, rewards

    def run() -> list:
        _load(folder, "cpu")
        move_loaded("cpu")
        return rewards(folder, "cpu", batch_size, max_tokens, pairs)

    return await asyncio.to_thread(run)


@pytest.mark.parametrize("runner", [None, in_a_thread], ids=["worker", "models_runner"])
@pytest.mark.parametrize("conversational", [True, False], ids=["messages", "prompt"])
async def test_a_reward_model_scores_what_trl_scores(reward_app, reward_model, conversational, runner):
    spec = {"type": "reward_model", "model": "rm"}
    prompt = {"messages": PROMPT} if conversational else {"prompt": "What is 6 x 7? "}
    items = [{"id": str(i), **prompt, "completion": c, "spec": spec} for i, c in enumerate(COMPLETIONS)]
    async with reward_app(sandbox="none", models={"rm": str(reward_model)}, model_batch_size=2,
                          models_runner=runner) as (_app, client):
        resp = await client.post("/v1/score", json={"items": items})
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
    prompts = [PROMPT] * len(COMPLETIONS) if conversational else ["What is 6 x 7? "] * len(COMPLETIONS)
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS] if conversational else COMPLETIONS
    expected = await asyncio.to_thread(trls_own, reward_model, prompts, completions)
    assert [r["status"] for r in results] == ["ok"] * len(COMPLETIONS), results
    assert [r["reward"] for r in results] == pytest.approx(expected, abs=1e-5)
    assert len({round(x, 6) for x in expected}) == len(COMPLETIONS)  # the completions tell the rewards apart


async def test_reward_models_compose_are_refused_by_name_and_bounded(reward_app, reward_model):
    combined = {"type": "combined", "parts": [{"weight": 1.0, "spec": {"type": "reward_model", "model": "rm"}},
                                              {"weight": 0.5, "spec": {"type": "exact", "answer": "42",
                                                                       "extract": "answer_tag"}}]}
    async with reward_app(sandbox="none", models={"rm": str(reward_model)}, model_max_tokens=40) as (_app, client):
        alone = (await client.post("/v1/score", json={"items": [
            {"id": "a", "prompt": "Q: ", "completion": "<answer>42</answer>",
             "spec": {"type": "reward_model", "model": "rm"}}]})).json()["results"][0]
        both = (await client.post("/v1/score", json={"items": [
            {"id": "b", "prompt": "Q: ", "completion": "<answer>42</answer>", "spec": combined}]})).json()["results"][0]
        assert both["reward"] == pytest.approx(alone["reward"] + 0.5, abs=1e-5), (alone, both)
        refused = await client.post("/v1/score", json={"items": [
            {"id": "c", "prompt": "Q: ", "completion": "x", "spec": {"type": "reward_model", "model": "other"}}]})
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["loc"] == ["body", "items", 0, "spec", "model"], refused.text
        assert "other is not a reward model of this reward server" in refused.text
        long = (await client.post("/v1/score", json={"items": [
            {"id": "d", "prompt": "Q: ", "completion": "x" * 60, "spec": {"type": "reward_model", "model": "rm"}}]}
                                  )).json()["results"][0]
        assert long["status"] == "reward_error" and long["reward"] is None
        assert "over model_max_tokens (40)" in long["detail"], long
