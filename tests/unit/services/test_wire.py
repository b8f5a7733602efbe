"""Wire types: round trips (property-based) and the invariants receivers rely on."""

from __future__ import annotations

import math
import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services import wire
from services.reward_specs import (
    CombinedSpec,
    ExactSpec,
    MathSpec,
    NumericSpec,
    PythonTestsSpec,
    RegexSpec,
    WeightedSpec,
)

logprob = st.floats(min_value=-50.0, max_value=0.0, allow_nan=False)


@st.composite
def samples(draw, version=None):
    n = draw(st.integers(min_value=0, max_value=64))
    ids = draw(st.lists(st.integers(min_value=0, max_value=200_000), min_size=n, max_size=n))
    lps = draw(st.lists(logprob, min_size=n, max_size=n))
    reward = draw(st.floats(min_value=-10, max_value=10, allow_nan=False))
    return wire.ScoredSample(
        token_ids=ids, logprobs=lps, text=draw(st.text(max_size=40)),
        finish_reason=draw(st.sampled_from(["stop", "length"])),
        policy_version=draw(st.integers(0, 5)) if version is None else version,
        reward=reward, status=draw(st.sampled_from(["ok", "wrong_answer", "timeout"])),
    )


@st.composite
def trajectory_groups(draw):
    ss = draw(st.lists(samples(), min_size=1, max_size=8))
    return wire.TrajectoryGroup(
        run_id="r", group_id=draw(st.text(min_size=1, max_size=20)), prompt=draw(st.text(max_size=50)),
        prompt_token_ids=draw(st.lists(st.integers(0, 1000), min_size=1, max_size=20)),
        samples=ss, n=len(ss), policy_version=min(s.policy_version for s in ss),
    )


specs = st.one_of(
    st.builds(ExactSpec, answer=st.text(max_size=10)),
    st.builds(NumericSpec, answer=st.floats(allow_nan=False, allow_infinity=False), tolerance=st.floats(0, 1)),
    st.builds(MathSpec, answer=st.text(min_size=1, max_size=10)),
    st.builds(RegexSpec, pattern=st.just(r"<answer>\d+</answer>")),
    st.builds(PythonTestsSpec, tests=st.just(["assert f(1) == 2"])),
)


@settings(max_examples=200, deadline=None)
@given(trajectory_groups())
def test_trajectory_group_round_trip(group):
    assert wire.decode(wire.TrajectoryGroup, wire.encode(group)) == group


@settings(max_examples=100, deadline=None)
@given(specs, st.integers(1, 64))
def test_prompt_group_round_trip_keeps_the_spec_type(spec, n):
    group = wire.PromptGroup(run_id="r", group_id="g1", prompt="1+1=", spec=spec, n=n)
    back = wire.decode(wire.PromptGroup, wire.encode(group))
    assert back == group and type(back.spec) is type(spec)


def test_combined_spec_nests():
    spec = CombinedSpec(parts=[
        WeightedSpec(weight=1.0, spec=ExactSpec(answer="4")),
        WeightedSpec(weight=0.1, spec=RegexSpec(pattern="<answer>")),
    ])
    group = wire.PromptGroup(run_id="r", group_id="g", prompt="2+2=", spec=spec, n=2)
    assert wire.decode(wire.PromptGroup, wire.encode(group)).spec.parts[1].spec.type == "regex"


def _sample(**kw):
    base = dict(token_ids=[1, 2], logprobs=[-0.1, -0.2], text="ab", finish_reason="stop",
                policy_version=3, reward=1.0, status="ok")
    return {**base, **kw}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"logprobs": [-0.1]}, "logprobs has 1 entries for 2 token_ids"),
        ({"logprobs": [-0.1, math.nan]}, "finite"),
        ({"logprobs": [-0.1, 0.5]}, "<= 0"),
        ({"token_ids": [1, -2]}, ">= 0"),
        ({"token_ids": [1, 2**70]}, "out of range"),  # a 422 at the edge, not a 500 (the services' fuzz test)
        ({"token_ids": [1, 2**31]}, "out of range"),
        ({"status": "sandbox_error"}, "only scored samples"),
        ({"reward": math.inf}, "finite"),
    ],
)
def test_sample_invariants(change, message):
    with pytest.raises(ValidationError, match=message):
        wire.ScoredSample(**_sample(**change))


def test_group_invariants():
    s3, s2 = _sample(), _sample(policy_version=2)
    ok = dict(run_id="r", group_id="g", prompt="p", prompt_token_ids=[1], samples=[s3, s2], n=2, policy_version=2)
    assert wire.TrajectoryGroup(**ok).policy_version == 2
    with pytest.raises(ValidationError, match="1 samples for a group of n=2"):
        wire.TrajectoryGroup(**{**ok, "samples": [s3]})
    with pytest.raises(ValidationError, match="not the oldest"):
        wire.TrajectoryGroup(**{**ok, "policy_version": 3})
    with pytest.raises(ValidationError, match="extra"):
        wire.TrajectoryGroup(**{**ok, "surprise": 1})


def test_score_result_reward_is_none_exactly_for_infra_failures():
    assert wire.ScoreResult(id="a", reward=None, status="sandbox_error").reward is None
    with pytest.raises(ValidationError):
        wire.ScoreResult(id="a", reward=0.0, status="sandbox_error")
    with pytest.raises(ValidationError):
        wire.ScoreResult(id="a", reward=None, status="wrong_answer")


def test_generate_request_needs_exactly_one_prompt():
    assert wire.GenerateRequest(prompt="hi").n == 1
    for bad in [{}, {"prompt": "a", "prompt_token_ids": [1]}, {"prompt": ""}, {"prompt_token_ids": []}]:
        with pytest.raises(ValidationError):
            wire.GenerateRequest(**bad)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02", msgpack.packb({"run_id": "r"})])
def test_decode_rejects_garbage_with_value_error(data):
    with pytest.raises(ValueError):
        wire.decode(wire.TrajectoryGroup, data)


def test_encoding_is_never_pickle():
    group = wire.PromptGroup(run_id="r", group_id="g", prompt="p", spec=ExactSpec(answer="1"), n=2)
    data = wire.encode(group)
    assert not data.startswith(b"\x80")  # pickle protocol marker
    assert msgpack.unpackb(data)["group_id"] == "g"


@pytest.mark.parametrize("field", ["answer", "tolerance"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_numeric_spec_refuses_non_finite_numbers(field, value):
    from services.reward_specs import NumericSpec

    body = {"answer": "1.0", field: value}
    with pytest.raises(ValueError, match=field):
        NumericSpec.model_validate_json("{" + ", ".join(f'"{k}": {v}' for k, v in body.items()) + "}")


def test_a_sample_spanning_versions_names_each_span_and_is_as_old_as_its_oldest_token():
    from services.wire import Sample

    base = {"token_ids": [1, 2, 3, 4], "logprobs": [-1.0] * 4, "text": "x", "finish_reason": "length"}
    s = Sample(**base, policy_version=3, token_versions=[(0, 3), (2, 4)])
    assert s.versions() == [3, 4] and Sample(**base, policy_version=3).versions() == [3]
    assert wire.decode(Sample, wire.encode(s)) == s
    for bad, why in [([(1, 3)], "spans must start at 0"), ([(0, 3), (4, 4)], "begin inside the 4 tokens"),
                     ([(0, 3), (2, 4), (2, 5)], "rise"), ([(0, 4), (2, 3)], "not the oldest token's (3)")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            Sample(**base, policy_version=4 if bad[0][1] == 4 else 3, token_versions=bad)
