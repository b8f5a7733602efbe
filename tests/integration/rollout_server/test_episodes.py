"""Multi-turn episodes on the session's real vLLM engine (rollout_server.episodes), and through the actor
with the real reward server's sandboxes.

The tiny model is first taught, in a few seconds of supervised training here, three scripts that call a
tool (``SCRIPTS``); it is loaded into the session engine as a new weight version. Its episodes then show:
the model's tokens kept verbatim across turns (their behaviour log-probs are those Hugging Face computes
on the exact ids, observation included), the observation's own ids under mask 0, error observations, the
turn and token limits, and a python tool whose output the reward never scores.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_server.engine import Sampling
from rollout_server.episodes import run_episodes
from rollout_server.tools import Session, ToolBox
from services import wire

pytestmark = pytest.mark.usefixtures("engine_left_serving")

SCRIPTS = {
    "C:": "<tool>calculator: 12+30</tool><result>42</result><answer>42</answer>",
    "E:": "<tool>calculator: 1/0</tool><error>division by zero</error><answer>0</answer>",
    # the model's own text never holds a whole answer tag: only the tool's output does
    "P:": '<tool>python: print("<ans"+"wer>4</ans"+"wer>")</tool><result><answer>4</answer></result>done',
}
CALL = {"C:": "<tool>calculator: 12+30</tool>", "E:": "<tool>calculator: 1/0</tool>",
        "P:": '<tool>python: print("<ans"+"wer>4</ans"+"wer>")</tool>'}
TEMPERATURE = 0.5
STEPS = 200


@pytest.fixture(scope="module")
def tool_weights(tiny_model, tmp_path_factory) -> Path:
    """The tiny model after a short supervised run on ``SCRIPTS`` (prompt -> call, observation, answer,
    end of sequence), as a weight version directory (safetensors only, the learner's layout)."""
    from examples.tiny import teach

    model, _tok, loss = teach(tiny_model, list(SCRIPTS.items()), STEPS)
    assert loss < 0.02, f"the scripts were not learnt (loss {loss:.3f})"
    full = tmp_path_factory.mktemp("tool-model")
    model.save_pretrained(full, safe_serialization=True)
    out = tmp_path_factory.mktemp("tool-weights")
    for f in full.glob("*.safetensors"):
        shutil.copy(f, out / f.name)
    return out.resolve()


async def _serve(engine, weight_versions, weights: Path) -> int:
    """Load ``weights`` into the session engine as a new version (unless it serves them); return the version."""
    from services.weightstore import digest

    if weight_versions.dirs.get(engine.version) != weights:
        v = weight_versions.next_version()
        weight_versions.dirs[v] = weights
        await engine.load_weights(wire.LoadWeights(version=v, uri=weights.as_uri(), sha256=digest(weights)))
    return engine.version


@pytest.fixture
async def tool_version(rollout_engine, weight_versions, tool_weights) -> int:
    return await _serve(rollout_engine, weight_versions, tool_weights)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


SAMPLING = Sampling(temperature=TEMPERATURE, max_tokens=128)


async def test_an_episode_keeps_the_models_tokens_and_masks_the_observation(
    rollout_engine, tool_version, weight_versions, hf_logprobs, tokenizer
):
    prompt = rollout_engine.tokenize("C:")
    spec = wire.EpisodeSpec(tools=["calculator"], max_turns=4)
    gen = await run_episodes(rollout_engine, prompt, SAMPLING, spec, 3, ToolBox())
    assert gen.prompt_token_ids == prompt and len(gen.samples) == 3
    observation = rollout_engine.tokenize("<result>42</result>", special=False)
    for s, text, f in zip(gen.samples, gen.texts, gen.fields, strict=True):
        assert (f["turns"], f["tool_calls"], f["tool_errors"]) == (2, 1, 0), s.text
        assert f["turn_versions"] == [tool_version, tool_version] and s.policy_version == tool_version
        (m1, _, a), (m0, b, c), (m2, _, end) = _segments(f["mask"])
        assert (m1, m0, m2, b, end) == (1, 0, 1, a, len(s.token_ids))
        assert tokenizer.decode(s.token_ids[:a]) == CALL["C:"]
        assert s.token_ids[b:c] == observation  # the observation's ids, tokenised on its own
        assert s.logprobs[b:c] == [0.0] * len(observation)
        assert s.text == CALL["C:"] + "<result>42</result>" + text and "<answer>42</answer>" in text
        assert s.finish_reason == "stop"
        # the engine read exactly these ids: its log-probs of the model's tokens (second turn included, after
        # the observation) are those of the weights on prompt + every completion token before each
        ref = hf_logprobs(weight_versions.dir_of(tool_version), prompt, s.token_ids, temperature=TEMPERATURE)
        model = [i for i, m in enumerate(f["mask"]) if m]
        assert max(abs(s.logprobs[i] - ref[i]) for i in model) < 2e-3


async def test_a_call_closed_before_min_tokens_is_answered_with_the_learners_log_probs(
    rollout_engine, tool_version, weight_versions, learner_logprobs, tokenizer
):
    """vLLM checks no stop string before a request's min_tokens: a call the model closes earlier would be
    written on past and never answered. The turn is cut after its ``</tool>`` and the call answered;
    ``min_tokens`` counts the model's tokens over the episode, and the behaviour log-probs of every turn
    are the learner's recomputation (the end tokens held back on the first min_tokens model tokens)."""
    import dataclasses

    prompt = rollout_engine.tokenize("C:")
    min_tokens = len(CALL["C:"]) + 8  # one token a character: the call is written well inside the minimum
    sampling = dataclasses.replace(SAMPLING, min_tokens=min_tokens)
    gen = await run_episodes(rollout_engine, prompt, sampling, wire.EpisodeSpec(tools=["calculator"], max_turns=4),
                             3, ToolBox())
    for s, f in zip(gen.samples, gen.fields, strict=True):
        assert f["tool_calls"] >= 1 and f["turns"] >= 2, s.text
        (m1, _, a), (m0, b, c), *_ = _segments(f["mask"])
        assert (m1, m0) == (1, 0) and tokenizer.decode(s.token_ids[:a]) == CALL["C:"], s.text
        assert s.text.startswith(CALL["C:"] + "<result>42</result>"), s.text
        learner = learner_logprobs(weight_versions.dir_of(tool_version), prompt, s.token_ids, f["mask"],
                                   temperature=TEMPERATURE, min_tokens=min_tokens)
        assert max(abs(x - y) for x, y, m in zip(s.logprobs, learner, f["mask"], strict=True) if m) < 2e-3


@dataclass
class ReloadingToolBox(ToolBox):
    """Tools whose first answer waits for ``reload`` (a new weight version loaded into the engine): the
    version changes between an episode's turns, while it waits on its tool, as when the learner publishes."""

    reload: Callable[[], Awaitable[None]] | None = None

    def session(self, budget_s: float | None = None) -> Session:
        return ReloadingSession(self)


class ReloadingSession(Session):
    async def answer(self, call, allowed, timeout_s):
        await self.box.reload()
        return await super().answer(call, allowed, timeout_s)


async def test_an_episode_spanning_a_reload_has_each_turns_version_and_the_oldest_as_its_own(
    rollout_engine, tool_version, weight_versions, tool_weights, hf_logprobs
):
    """Version v writes the call, v+1 (the same weights, published again) the answer after the observation:
    each turn is tagged with the version that generated it, the sample with the oldest (staleness is judged
    by it), and each turn's behaviour log-probs are those of its own version's weights."""
    from services.weightstore import digest

    newer = weight_versions.next_version()
    weight_versions.dirs[newer] = tool_weights
    load = wire.LoadWeights(version=newer, uri=tool_weights.as_uri(), sha256=digest(tool_weights))
    loading: list[asyncio.Task] = []

    async def reload() -> None:
        if not loading:  # the first episode to reach its tool loads it; the others wait for the same load
            loading.append(asyncio.ensure_future(rollout_engine.load_weights(load)))
        await loading[0]

    prompt = rollout_engine.tokenize("C:")
    spec = wire.EpisodeSpec(tools=["calculator"], max_turns=4)
    gen = await run_episodes(rollout_engine, prompt, SAMPLING, spec, 2, ReloadingToolBox(reload=reload))
    assert rollout_engine.version == newer
    for s, f in zip(gen.samples, gen.fields, strict=True):
        assert (f["turns"], f["tool_calls"]) == (2, 1), s.text
        assert f["turn_versions"] == [tool_version, newer] and s.policy_version == tool_version
        scored = wire.ScoredSample(**s.model_dump(), reward=1.0, status="ok", **f)  # the trajectory's sample accepts it
        assert (scored.policy_version, scored.turn_versions) == (tool_version, [tool_version, newer])
        (_, _, a), (_, b, c), (_, _, end) = _segments(f["mask"])
        for version, (start, stop) in zip(f["turn_versions"], [(0, a), (c, end)], strict=True):
            ref = hf_logprobs(weight_versions.dir_of(version), prompt, s.token_ids, temperature=TEMPERATURE)
            assert max(abs(s.logprobs[i] - ref[i]) for i in range(start, stop)) < 2e-3


def test_an_observation_is_tokenised_literally_never_as_special_tokens(rollout_engine):
    # a tool's output is the policy's program's (or a user tool's) text: the texts of the model's special
    # tokens in it must not become those tokens (an EOS would end the turn, a chat tag forge a new one)
    tok = rollout_engine.tokenizer
    specials = tok.all_special_tokens
    assert {"<eos>", "<bos>", "<pad>"} <= set(specials)
    text = "<result>" + "x".join(specials) + "</result>"
    ids = rollout_engine.tokenize(text, special=False)
    assert not set(ids) & set(tok.all_special_ids), ids
    assert tok.decode(ids) == text  # every character kept, as ordinary tokens
    # a prompt's text is the run author's: there, as in vLLM, the texts are read as the special tokens
    assert set(rollout_engine.tokenize("<eos>")) <= set(tok.all_special_ids)


@pytest.mark.parametrize(("prompt", "tools", "said"), [
    ("E:", ["calculator"], "<error>division by zero</error>"),
    ("C:", [], "<error>unknown tool 'calculator'; this episode allows: none</error>"),
])
async def test_a_failing_call_is_an_error_observation_and_the_episode_goes_on(
    rollout_engine, tool_version, prompt, tools, said
):
    spec = wire.EpisodeSpec(tools=tools, max_turns=3)
    gen = await run_episodes(rollout_engine, rollout_engine.tokenize(prompt), SAMPLING, spec, 2, ToolBox())
    for s, f in zip(gen.samples, gen.fields, strict=True):
        assert (f["tool_calls"], f["tool_errors"]) == (1, 1) and f["turns"] >= 2, s.text
        (_, _, a), (m0, b, c), *_rest = _segments(f["mask"])
        assert m0 == 0 and s.token_ids[b:c] == rollout_engine.tokenize(said, special=False)
        assert s.text.startswith(CALL[prompt] + said)


async def test_the_turn_and_token_limits_end_an_episode(rollout_engine, tool_version):
    prompt = rollout_engine.tokenize("C:")
    # one turn: the call is not answered
    gen = await run_episodes(rollout_engine, prompt, SAMPLING, wire.EpisodeSpec(tools=["calculator"], max_turns=1),
                             2, ToolBox())
    for s, text, f in zip(gen.samples, gen.texts, gen.fields, strict=True):
        assert s.text == text == CALL["C:"] and f["mask"] == [1] * len(s.token_ids)
        assert (f["turns"], f["tool_calls"], s.finish_reason) == (1, 0, "stop")
    # a budget that ends inside the observation: it is cut there, and the episode ends with "length"
    budget = len(rollout_engine.tokenize(CALL["C:"], special=False)) + 3
    gen = await run_episodes(rollout_engine, prompt, SAMPLING, wire.EpisodeSpec(tools=["calculator"], max_tokens=budget),
                             2, ToolBox())
    for s, f in zip(gen.samples, gen.fields, strict=True):
        assert len(s.token_ids) == budget and s.finish_reason == "length", s.text
        assert f["mask"][-3:] == [0, 0, 0] and (f["turns"], f["tool_calls"]) == (1, 1)


def _config(tiny_model, tmp_path):
    from services.config import RunConfig

    train = tmp_path / "train.jsonl"
    train.write_text("")
    return RunConfig.model_validate({
        "name": "episode-test", "model": {"path": str(tiny_model), "max_model_len": 256}, "data": {"train": str(train)},
        "sampling": {"group_size": 2, "max_tokens": 128, "temperature": TEMPERATURE},
        "learner": {"groups_per_step": 2}, "staleness": {"max_staleness": 0, "lease_s": 60, "visibility_timeout_s": 60},
    })


async def test_the_actor_runs_an_episode_group_and_scores_only_the_models_last_turn(
    rollout_engine, redis, keys, tiny_model, tmp_path, weight_versions, tool_weights, reward_servers
):
    """A group whose line has an episode, through the actor with a python tool in the bubblewrap sandboxes:
    the tool prints the right answer's tag, the model's last turn says ``done``, and the reward is 0 (only
    the model's own last turn is scored); the trajectory carries the mask and the per-turn versions. A group
    naming a tool the server lacks is dead-lettered."""
    from broker import Envelope, Stream, WeightRegistry
    from broker.weight_versions import WeightVersion
    from rollout_server.actor import Actor
    from services.clients import RewardClient
    from services.reward_specs import ExactSpec
    from services.weightstore import digest
    from tests.fixtures.reward import REWARD_TOKEN

    version = weight_versions.next_version()
    weight_versions.dirs[version] = tool_weights
    await WeightRegistry(redis, keys).publish(WeightVersion(
        version=version, uri=tool_weights.as_uri(), sha256=digest(tool_weights), created_at=time.time()))
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    groups = {
        "forge": wire.PromptGroup(run_id=keys.run_id, group_id="forge", prompt="P:", n=2, spec=ExactSpec(answer="4"),
                                  episode=wire.EpisodeSpec(tools=["python"], tool_timeout_s=30)),
        "no-tool": wire.PromptGroup(run_id=keys.run_id, group_id="no-tool", prompt="C:", n=2,
                                    spec=ExactSpec(answer="42"), episode=wire.EpisodeSpec(tools=["nope"])),
    }
    await prompts.add_many([Envelope(g.group_id, -1, wire.encode(g)) for g in groups.values()])
    reward = RewardClient(reward_servers["bwrap"].url, REWARD_TOKEN, attempts=2, max_total_s=60)
    actor = Actor(rollout_engine, redis=redis, keys=keys, config=_config(tiny_model, tmp_path), reward=reward,
                  server_id=f"test-{keys.run_id}", metrics=rollout_engine.metrics, concurrency=2)
    task = asyncio.create_task(actor.run())
    try:
        traj = Stream.trajectories(redis, keys)
        await traj.ensure_group()
        got = []
        deadline = time.monotonic() + 120
        while not (got and await prompts.dead_letters()):
            assert time.monotonic() < deadline and not task.done(), "the episode group never came"
            got += await traj.read("learner", count=1, block_ms=300)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reward.aclose()
    [delivery] = got
    g = wire.decode(wire.TrajectoryGroup, delivery.envelope.payload)
    assert g.group_id == "forge" and g.policy_version == version
    observation = rollout_engine.tokenize("<result><answer>4</answer></result>", special=False)
    for s in g.samples:
        assert s.text == CALL["P:"] + "<result><answer>4</answer></result>done", s.text
        assert (s.reward, s.status) == (0.0, "no_answer")
        assert (s.turns, s.turn_versions, s.tool_calls, s.tool_errors) == (2, [version, version], 1, 0)
        (_, _, a), (m0, b, c), (m2, _, end) = _segments(s.mask)
        assert (m0, m2, end) == (0, 1, len(s.token_ids)) and s.token_ids[b:c] == observation
    [dead] = await prompts.dead_letters()
    assert dead["g"] == "no-tool" and "episode.tools: this server has no tool 'nope'" in dead["reason"]


async def test_held_out_episode_prompts_are_evaluated_as_episodes(
    rollout_engine, redis, keys, tiny_model, tmp_path, weight_versions, tool_weights, reward_servers
):
    """``eval.every`` on held-out lines with an episode: "C:" is answered 42 through the calculator's
    observation (greedy), and "P:", whose python tool prints the answer tag, scores 0 (the model's last turn
    only), so the recorded accuracy is 1/2; the sample scored for "C:" is the turn after the observation."""
    from broker import Stream, WeightRegistry
    from broker.weight_versions import WeightVersion
    from rollout_server.actor import Actor
    from services.clients import RewardClient
    from services.evaluate import EvalLog
    from services.reward_specs import ExactSpec
    from services.weightstore import digest
    from tests.fixtures.reward import REWARD_TOKEN

    version = weight_versions.next_version()
    weight_versions.dirs[version] = tool_weights
    await WeightRegistry(redis, keys).publish(WeightVersion(
        version=version, uri=tool_weights.as_uri(), sha256=digest(tool_weights), created_at=time.time()))
    await Stream.prompts(redis, keys).ensure_group()
    held_out = [
        wire.EvalPrompt(prompt="C:", spec=ExactSpec(answer="42"), episode=wire.EpisodeSpec(tools=["calculator"])),
        wire.EvalPrompt(prompt="P:", spec=ExactSpec(answer="4"),
                        episode=wire.EpisodeSpec(tools=["python"], tool_timeout_s=30)),
    ]
    log = EvalLog(redis, keys)
    await log.store_prompts(held_out)
    config = _config(tiny_model, tmp_path).model_copy(update={"eval": wire_eval(every=1)})
    reward = RewardClient(reward_servers["bwrap"].url, REWARD_TOKEN, attempts=2, max_total_s=60)
    actor = Actor(rollout_engine, redis=redis, keys=keys, config=config, reward=reward,
                  server_id=f"test-{keys.run_id}", metrics=rollout_engine.metrics, concurrency=2)
    task = asyncio.create_task(actor.run())
    try:
        deadline = time.monotonic() + 120
        while version not in (points := await log.points()):
            assert time.monotonic() < deadline and not task.done(), "the held-out evaluation was never recorded"
            await asyncio.sleep(0.3)
        [sample] = await actor._eval_one(0, held_out[0])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reward.aclose()
    assert (points[version].accuracy, points[version].count) == (0.5, 2)
    assert sample.text == "<answer>42</answer>" and sample.policy_version == version
    assert rollout_engine.tokenizer.decode(sample.token_ids).startswith(CALL["C:"] + "<result>42</result>")


def wire_eval(**fields):
    from services.config import EvalConfig

    return EvalConfig.model_validate({"before": False, **fields})


async def test_held_out_episode_prompts_are_evaluated_as_episodes_over_http(
    rollout_server, tool_version, tiny_model, tmp_path, reward_servers
):
    """``services.evaluate.evaluate`` (``tandem run``'s final evaluation) sends a line's episode with
    ``/v1/generate``: the rollout server answers the calculator call and returns the model's last turn, which
    is what gets scored. "P:" would be right single-turn (the model writes the answer tag the tool would print);
    as an episode its python call fails here (the fixture's server has no reward server) and its last turn
    holds no answer, so the accuracy is 1/2. A tool the server lacks is a 422 naming ``episode.tools``."""
    import httpx

    from services.clients import RewardClient, RolloutClient
    from services.evaluate import evaluate
    from services.reward_specs import ExactSpec
    from tests.fixtures.reward import REWARD_TOKEN

    held_out = [wire.EvalPrompt(prompt="C:", spec=ExactSpec(answer="42"), episode=wire.EpisodeSpec(tools=["calculator"])),
                wire.EvalPrompt(prompt="P:", spec=ExactSpec(answer="4"), episode=wire.EpisodeSpec(tools=["python"]))]
    async with RolloutClient(rollout_server.url, rollout_server.token) as rollout, \
            RewardClient(reward_servers["bwrap"].url, REWARD_TOKEN, attempts=2, max_total_s=60) as reward:
        out = await rollout.generate(wire.GenerateRequest(prompt="C:", max_tokens=128, temperature=0, n=2,
                                                          episode=held_out[0].episode))
        result = await evaluate(rollout, reward, held_out, _config(tiny_model, tmp_path))
        with pytest.raises(httpx.HTTPStatusError) as refused:
            await rollout.generate(wire.GenerateRequest(prompt="C:", episode=wire.EpisodeSpec(tools=["nope"])))
    assert out.last_turns == ["<answer>42</answer>"] * 2
    assert [s.text for s in out.samples] == [CALL["C:"] + "<result>42</result><answer>42</answer>"] * 2
    assert (result.accuracy, result.count, result.versions) == (0.5, 2, frozenset({tool_version}))
    assert refused.value.response.status_code == 422
    assert refused.value.response.json()["detail"][0]["loc"] == ["body", "episode.tools"]
