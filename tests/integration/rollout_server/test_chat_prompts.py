"""Chat messages on the session's real vLLM engine: the rollout server renders them with the model's own
chat template (``examples.tiny.CHAT_TEMPLATE`` on the tiny model: one token per character) and generates
from exactly those token ids, over HTTP, in the actor's training groups and in both held-out evaluations
(the actor's and ``tandem run``'s over HTTP), with the run's ``chat_template_kwargs``."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from broker import Envelope, Stream, WeightRegistry
from services import wire
from services.clients import RewardClient, RolloutClient
from services.config import PromptConfig
from services.reward_specs import RegexSpec
from tests.fixtures.rollout import TOKEN
from tests.integration.rollout_server.test_actor import (  # noqa: F401  actor_factory is a fixture
    _config,
    _load_request,
    _publish,
    _wait_points,
    actor_factory,
)

pytestmark = pytest.mark.usefixtures("engine_left_serving")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
RENDERED = "<bos><|system|>Be brief.\n<|user|>2+2?\n<|assistant|>"
NO_THINKING = RENDERED + "<think></think>"  # enable_thinking = false


def char_ids(text: str, tiny_model) -> list[int]:
    """The tiny tokenizer's ids of ``text``, character by character (``<bos>`` is one token)."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(tiny_model).get_vocab()
    assert text.startswith("<bos>")
    return [vocab["<bos>"]] + [vocab[c] for c in text[len("<bos>"):]]


def with_kwargs(config, **kwargs):
    return config.model_copy(update={"prompt": PromptConfig(chat_template_kwargs=kwargs)})


async def test_generate_renders_messages_with_the_models_chat_template(rollout_server, tiny_model):
    import httpx

    async with httpx.AsyncClient(base_url=rollout_server.url, headers=rollout_server.headers, timeout=60) as http:
        plain = await http.post("/v1/generate", json={"messages": CHAT, "max_tokens": 2, "seed": 0})
        assert plain.status_code == 200, plain.text
        assert plain.json()["prompt_token_ids"] == char_ids(RENDERED, tiny_model)
        off = await http.post("/v1/generate", json={"messages": CHAT, "max_tokens": 2, "seed": 0,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
        assert off.json()["prompt_token_ids"] == char_ids(NO_THINKING, tiny_model)
        bad = await http.post("/v1/generate", json={"messages": [*CHAT, {"role": "assistant", "content": "4"}]})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "messages", bad.text
        both = await http.post("/v1/generate", json={"messages": CHAT, "prompt": "x"})
        assert both.status_code == 422 and "exactly one of" in both.text, both.text


async def test_the_actor_generates_a_messages_group_from_the_rendered_ids(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine  # noqa: F811
):
    config = with_kwargs(_config(tiny_model, tmp_path, eta=1, groups_per_step=2), enable_thinking=False)
    await _publish(WeightRegistry(redis, keys), weight_versions, 200, weight_versions.next_version())
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    groups = [
        wire.PromptGroup(run_id=keys.run_id, group_id=f"chat-{uuid.uuid4().hex[:6]}", messages=CHAT, n=2,
                         spec=RegexSpec(pattern="a")),
        wire.PromptGroup(run_id=keys.run_id, group_id=f"text-{uuid.uuid4().hex[:6]}", prompt="2+2=", n=2, index=1,
                         spec=RegexSpec(pattern="a")),
    ]
    await prompts.add_many([Envelope(g.group_id, -1, wire.encode(g)) for g in groups])
    actor_factory(config)
    traj = Stream.trajectories(redis, keys)
    await traj.ensure_group()
    got: dict[str, wire.TrajectoryGroup] = {}
    deadline = time.monotonic() + 60
    while len(got) < 2:
        assert time.monotonic() < deadline, f"only {sorted(got)} came back"
        for d in await traj.read("learner", count=2, block_ms=300):
            g = wire.decode(wire.TrajectoryGroup, d.envelope.payload)
            got[g.group_id.split("-")[0]] = g
    assert got["chat"].prompt_token_ids == char_ids(NO_THINKING, tiny_model)
    assert got["chat"].prompt == NO_THINKING  # the text the model read
    assert got["text"].prompt_token_ids == rollout_engine.tokenize("2+2=") and got["text"].prompt == "2+2="


class GenerateRecorder:
    """ASGI wrapper: the ``prompt_token_ids`` of every ``POST /v1/generate`` response (what the server
    generated from), in order."""

    def __init__(self, app) -> None:
        self.app = app
        self.prompt_ids: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/generate":
            return await self.app(scope, receive, send)
        body = bytearray()

        async def keep(message):
            if message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    self.prompt_ids.append(json.loads(bytes(body))["prompt_token_ids"])
            await send(message)

        return await self.app(scope, receive, keep)


async def test_held_out_messages_are_rendered_with_the_runs_kwargs_in_both_evaluations(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine, rollout_server,  # noqa: F811
    reward_service, serve_app,
):
    """``tandem run``'s evaluation over HTTP generates from exactly the ids the run's kwargs render (the
    responses say which); the actor's evaluation processes as many prompt tokens as they have (15 more
    characters than without ``enable_thinking = false``)."""
    from services.evaluate import EvalLog, evaluate

    base = _config(tiny_model, tmp_path, eta=1, groups_per_step=2)
    base = base.model_copy(update={"eval": base.eval.model_copy(update={"every": 1})})
    config = with_kwargs(base, enable_thinking=False)
    held_out = [wire.EvalPrompt(messages=CHAT, spec=RegexSpec(pattern="a"))]

    recorder = GenerateRecorder(rollout_server.app)
    async with serve_app(recorder) as running, RolloutClient(running.url, TOKEN) as rollout, \
            RewardClient(reward_service.url, TOKEN) as reward:
        assert (await evaluate(rollout, reward, held_out, config)).count == 1
        assert (await evaluate(rollout, reward, held_out, base)).count == 1
    assert recorder.prompt_ids == [char_ids(NO_THINKING, tiny_model), char_ids(RENDERED, tiny_model)]

    registry = WeightRegistry(redis, keys)
    version = weight_versions.next_version()
    await _publish(registry, weight_versions, 201, version)
    await rollout_engine.load_weights(await _load_request(registry, version))
    await EvalLog(redis, keys).store_prompts(held_out)
    prompt_tokens = rollout_engine.metrics.registry.get_sample_value
    before = prompt_tokens("tandem_rollout_prompt_tokens_total")
    _actor, task = actor_factory(config)  # no training groups: the evaluation is all it generates
    points = await _wait_points(redis, keys, {version}, task)
    assert points[version].count == 1
    assert prompt_tokens("tandem_rollout_prompt_tokens_total") - before == len(char_ids(NO_THINKING, tiny_model))
