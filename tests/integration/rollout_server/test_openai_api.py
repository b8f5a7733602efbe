"""The OpenAI-compatible routes and vLLM's token-in route on the session's real vLLM engine (CPU), over HTTP,
driven by the ``openai`` client where it can be: shapes, token ids equal to what the engine samples for the
same ids and seed on ``/v1/generate``, log-probabilities of the behaviour policy, weight versions, 422s."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.integration.rollout_server.test_chat_prompts import CHAT, RENDERED, char_ids

pytestmark = pytest.mark.usefixtures("engine_left_serving")


def _openai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.token, max_retries=0, timeout=120)


def _http(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120)


def _model(server) -> str:
    return server.app.state.engine.model_dir.name


async def _generate(server, **body) -> dict:
    async with _http(server) as c:
        r = await c.post("/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_models_lists_the_served_model(rollout_server):
    engine = rollout_server.app.state.engine
    listed = await _openai(rollout_server).models.list()
    [card] = listed.data
    assert card.id == _model(rollout_server)
    assert card.model_extra["max_model_len"] == engine.max_model_len
    assert card.model_extra["weight_version"] == engine.version


async def test_chat_completion_carries_the_engines_token_ids_logprobs_and_version(rollout_server, tiny_model,
                                                                                  hf_logprobs, weight_versions):
    engine = rollout_server.app.state.engine
    out = await _openai(rollout_server).chat.completions.create(
        model=_model(rollout_server), messages=CHAT, n=4, max_tokens=12, temperature=1.0, seed=5)
    assert out.object == "chat.completion" and out.model == _model(rollout_server)
    extra = out.model_extra
    assert extra["prompt_token_ids"] == char_ids(RENDERED, tiny_model)  # the model's own chat template
    assert extra["weight_version"] == engine.version
    assert len(out.choices) == 4
    # the same ids and seed on the native route sample the very same tokens
    native = await _generate(rollout_server, prompt_token_ids=extra["prompt_token_ids"], n=4, max_tokens=12,
                             temperature=1.0, seed=5)
    for choice, sample in zip(out.choices, native["samples"], strict=True):
        ids = choice.model_extra["token_ids"]
        assert ids == sample["token_ids"]
        assert choice.message.role == "assistant" and choice.message.content == sample["text"]
        assert choice.finish_reason == sample["finish_reason"]
        assert choice.model_extra["weight_version"] == sample["policy_version"] == engine.version
        lps = [e.logprob for e in choice.logprobs.content]
        assert lps == pytest.approx(sample["logprobs"], abs=1e-6)
        assert all(math.isfinite(x) and x <= 0 for x in lps)
        assert [e.token for e in choice.logprobs.content] == [engine.tokenizer.decode([t]) for t in ids]
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
        ref = hf_logprobs(weight_versions.dir_of(engine.version), extra["prompt_token_ids"], ids)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 2e-3
    assert out.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert out.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in out.choices)


async def test_completions_text_and_token_id_prompts(rollout_server):
    engine = rollout_server.app.state.engine
    client = _openai(rollout_server)
    text = await client.completions.create(model=_model(rollout_server), prompt="The answer is", max_tokens=10,
                                           n=2, seed=9, extra_body={"return_tokens_as_token_ids": True})
    prompt_ids = text.model_extra["prompt_token_ids"]
    assert prompt_ids == engine.tokenize("The answer is")
    by_ids = await client.completions.create(model=str(engine.model_dir), prompt=prompt_ids, max_tokens=10, n=2,
                                             seed=9)
    assert by_ids.model_extra["prompt_token_ids"] == prompt_ids
    for a, b in zip(text.choices, by_ids.choices, strict=True):
        assert a.model_extra["token_ids"] == b.model_extra["token_ids"]
        assert a.text == b.text
        assert a.logprobs.tokens == [f"token_id:{t}" for t in a.model_extra["token_ids"]]
        assert b.logprobs.tokens == [engine.tokenizer.decode([t]) for t in b.model_extra["token_ids"]]
        assert engine.tokenizer.decode(b.model_extra["token_ids"], skip_special_tokens=True) == b.text
        assert b.logprobs.text_offset[0] == 0 and len(b.logprobs.token_logprobs) == len(b.model_extra["token_ids"])
        assert a.model_extra["weight_version"] == engine.version


async def test_streamed_chat_equals_the_whole_answer(rollout_server):
    client = _openai(rollout_server)
    body = dict(model=_model(rollout_server), messages=CHAT, max_tokens=10, seed=21)
    whole = await client.chat.completions.create(**body)
    stream = await client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    content, usage, ids = "", None, []
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            ids += c.model_extra["token_ids"]
        usage = chunk.usage or usage
    assert content == whole.choices[0].message.content
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_tools_reach_the_template_and_the_answer_is_tagged_after_a_reload(rollout_server, weight_versions):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    client = _openai(rollout_server)
    async with _http(rollout_server) as c:
        req = weight_versions.make(seed=131)
        r = await c.post("/v1/weights", json=req.model_dump())
        assert r.status_code == 200, r.text
    messages = [*CHAT, {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    out = await client.chat.completions.create(model=_model(rollout_server), messages=messages, tools=tools,
                                               max_tokens=6, seed=1)
    assert out.model_extra["weight_version"] == req.version
    assert out.choices[0].model_extra["weight_version"] == req.version
    assert "<|tool|>4\n<|assistant|>" in "".join(
        rollout_server.app.state.engine.tokenizer.decode(out.model_extra["prompt_token_ids"]))


async def test_token_in_route_honours_stop_token_ids(rollout_server):
    engine = rollout_server.app.state.engine
    prompt = engine.tokenize("The answer is")
    params = {"max_tokens": 24, "temperature": 1.0, "seed": 4, "logprobs": 1, "skip_special_tokens": False}
    async with _http(rollout_server) as c:
        r = await c.post("/inference/v1/generate", json={"model": _model(rollout_server), "token_ids": prompt,
                                                          "sampling_params": params})
        assert r.status_code == 200, r.text
        full = r.json()
        ids = full["choices"][0]["token_ids"]
        assert full["prompt_token_ids"] == prompt and full["weight_version"] == engine.version
        assert [e["token"] for e in full["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
        j = next(i for i, t in enumerate(ids) if i > 0 and t not in ids[:i])
        r = await c.post("/inference/v1/generate", json={"token_ids": prompt,
                                                          "sampling_params": {**params, "stop_token_ids": [ids[j]]}})
    stopped = r.json()["choices"][0]
    assert stopped["token_ids"] == ids[: j + 1] and stopped["finish_reason"] == "stop"


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 17}, "n"),  # the fixture server's max_n is 16
        ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": CHAT, "temprature": 0.5}, "temprature"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10_000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10_000}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "4"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 10_000]}, "prompt"),
        ("/v1/completions", {"prompt": "The", "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "The", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "The", "best_of": 2}, "best_of"),
        ("/inference/v1/generate", {"token_ids": []}, "token_ids"),
        ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"max_tokens": 10_000}}, "max_tokens"),
        ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
    ],
)
async def test_bad_fields_are_422_in_openais_shape_naming_the_field(rollout_server, path, body, param):
    async with _http(rollout_server) as c:
        r = await c.post(path, json={"model": _model(rollout_server), **body})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(f"{param}."), error
    assert r.json()["detail"][0]["loc"][1] == param.split(".")[0]


async def test_unknown_model_is_404_and_a_wrong_key_401(rollout_server):
    with pytest.raises(openai.NotFoundError) as e:
        await _openai(rollout_server).chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    wrong = openai.AsyncOpenAI(base_url=f"{rollout_server.url}/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(model=_model(rollout_server), messages=CHAT, max_tokens=2)
