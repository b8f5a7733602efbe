"""Episodes on the wire (issue 26): the prompt-set line's ``episode``, ``PromptGroup.episode`` and the
episode fields of ``ScoredSample`` (mask, turns, per-turn versions, tool-call counts), validated at the edge."""

from __future__ import annotations

import pydantic
import pytest

from control_plane.groups import build_groups
from services import wire
from services.config import parse_run_config
from services.prompt_lines import LineError, LineParser, check_line

SCORED = dict(token_ids=[5, 6, 7, 8], logprobs=[-0.1, 0.0, 0.0, -0.2], text="x", finish_reason="stop",
              policy_version=3, reward=1.0, status="ok")


def test_an_episode_sample_round_trips_through_the_binary_encoding():
    s = wire.ScoredSample(**SCORED, mask=[1, 0, 0, 1], turns=2, turn_versions=[4, 3], tool_calls=1, tool_errors=1)
    back = wire.decode(wire.ScoredSample, wire.encode(s))
    assert back == s and back.mask == [1, 0, 0, 1] and back.turn_versions == [4, 3]


def test_a_single_turn_sample_has_the_defaults():
    s = wire.ScoredSample(**SCORED)
    assert (s.mask, s.turns, s.turn_versions, s.tool_calls, s.tool_errors) == ([], 1, [], 0, 0)
    assert wire.decode(wire.ScoredSample, wire.encode(s)) == s


@pytest.mark.parametrize(("extra", "field", "words"), [
    (dict(mask=[1, 0, 1]), "", "mask has 3 entries for 4 token_ids"),
    (dict(mask=[1, 0, 2, 1]), "mask.2", "less than or equal to 1"),
    (dict(turns=2, turn_versions=[3]), "", "turn_versions has 1 entries for 2 turns"),
    (dict(turns=2, turn_versions=[4, 5]), "", "not the oldest turn's (4)"),
    (dict(tool_calls=1, tool_errors=2), "", "tool_errors 2 > tool_calls 1"),
])
def test_bad_episode_fields_are_refused_naming_the_field(extra, field, words):
    with pytest.raises(pydantic.ValidationError) as e:
        wire.ScoredSample(**SCORED, **extra)
    err = e.value.errors()[0]
    assert ".".join(str(p) for p in err["loc"]) == field and words in err["msg"]


def test_a_line_with_an_episode_becomes_a_group_with_it():
    line = {"prompt": "2+2=", "type": "exact", "answer": "4",
            "episode": {"tools": ["calculator", "python"], "max_turns": 3, "max_tokens": 100}}
    stored, errors = check_line(line, 1, "math")
    assert not errors and stored["episode"]["tools"] == ["calculator", "python"]
    plain, _ = check_line({"prompt": "2+2=", "type": "exact", "answer": "4"}, 2, "math")
    assert "episode" not in plain
    groups = build_groups("r", [stored, plain], parse_run_config({"model": {"path": "m"}, "data": {"train": "t"}}))
    assert groups[0].episode == wire.EpisodeSpec(tools=["calculator", "python"], max_turns=3, max_tokens=100)
    assert groups[1].episode is None
    assert wire.decode(wire.PromptGroup, wire.encode(groups[0])) == groups[0]


def test_a_held_out_line_with_an_episode_keeps_it():
    from services.evaluate import eval_prompts

    line = {"prompt": "2+2=", "type": "exact", "answer": "4", "episode": {"tools": ["calculator"], "max_turns": 2}}
    stored, errors = check_line(line, 1, "math")
    plain, _ = check_line({"prompt": "2+2=", "type": "exact", "answer": "4"}, 2, "math")
    held_out = eval_prompts([stored, plain], parse_run_config({"model": {"path": "m"}, "data": {"train": "t"}}))
    assert held_out[0].episode == wire.EpisodeSpec(tools=["calculator"], max_turns=2)
    assert held_out[1].episode is None
    assert wire.decode(wire.EvalPrompt, wire.encode(held_out[0])) == held_out[0]
    # what services.evaluate.evaluate sends for it over HTTP
    request = wire.GenerateRequest(prompt="2+2=", episode=held_out[0].episode)
    assert wire.GenerateRequest.model_validate_json(request.model_dump_json()) == request


@pytest.mark.parametrize(("episode", "field"), [
    ({"tools": ["Calc"]}, "episode.tools.0"),
    ({"max_turns": 0}, "episode.max_turns"),
    ({"max_tokens": 0}, "episode.max_tokens"),
    ({"tool_timeout_s": 0}, "episode.tool_timeout_s"),
    ({"tools": ["calculator", "calculator"]}, "episode"),
    ({"turns": 3}, "episode.turns"),
    ("calculator", "episode"),
])
def test_an_upload_with_a_bad_episode_is_refused_naming_the_field(episode, field):
    import json

    parser = LineParser()
    parser.feed(json.dumps({"prompt": "1+1=", "type": "exact", "answer": "2", "episode": episode}).encode() + b"\n")
    with pytest.raises(LineError) as e:
        parser.finish()
    assert [err["field"] for err in e.value.errors] == [field]


def test_a_step_of_episodes_reports_turns_and_tool_calls():
    from learner.trainer import episode_means

    def sample(turns: int, calls: int, errors: int) -> wire.ScoredSample:
        return wire.ScoredSample(**SCORED | {"policy_version": 3}, turns=turns, turn_versions=[3] * turns,
                                 tool_calls=calls, tool_errors=errors)

    def group(*samples) -> wire.TrajectoryGroup:
        return wire.TrajectoryGroup(run_id="r", group_id="g", prompt="", prompt_token_ids=[1], samples=list(samples),
                                    n=len(samples), policy_version=3)

    assert episode_means([group(wire.ScoredSample(**SCORED))]) == {}
    got = episode_means([group(sample(2, 1, 0), sample(3, 2, 1)), group(sample(1, 0, 0), sample(1, 1, 1))])
    assert got == {"episode_turns_mean": 7 / 4, "tool_calls_mean": 1.0, "tool_success_frac": 0.5}
    assert episode_means([group(sample(1, 0, 0))]) == {"episode_turns_mean": 1.0, "tool_calls_mean": 0.0}
