"""The reward-function worker's pure parts: the allow-list match, loading by name, what a result may be."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest

from reward_server.verifiers.function_worker import (
    FunctionError,
    call,
    load,
    match,
    normalise,
    resolve,
)


def test_allow_list_names_the_module_exactly():
    patterns = ["my_rewards:*", "scoring.code:passes"]
    assert match("my_rewards:length", patterns) == "my_rewards:*"
    assert match("scoring.code:passes", patterns) == "scoring.code:passes"
    assert match("scoring.code:fails", patterns) is None
    assert match("my_rewards.sub:length", patterns) is None  # a submodule is another module
    assert match("os:system", patterns) is None
    assert match("my_rewards:length", []) is None
    assert match("m:f", ["m:*", "m:f"]) == "m:f"  # the exact pattern wins: it may name any callable


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = f"rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import functools\n"
        "from os import system\n"
        "def length(prompts, completions, **kwargs):\n"
        "    return [len(c) for c in completions]\n"
        "def _hidden(prompts, completions, **kwargs):\n"
        "    return [0.0] * len(completions)\n"
        "def scaled(prompts, completions, solution, scale=1.0, **kwargs):\n"
        "    return [scale * (c == s) for c, s in zip(completions, solution)]\n"
        "def boom(prompts, completions, **kwargs):\n"
        "    return {}['missing']\n"
        "partial_length = functools.partial(length)\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_under_a_glob_takes_public_functions_of_the_module_only(module):
    glob = f"{module}:*"
    assert load(f"{module}:length", glob)(prompts=["p"], completions=["abc"]) == [3]
    with pytest.raises(FunctionError, match="private"):
        load(f"{module}:_hidden", glob)
    with pytest.raises(FunctionError, match="not a function defined in"):
        load(f"{module}:system", glob)  # imported from os: not the module's own
    with pytest.raises(FunctionError, match="not a function defined in"):
        load(f"{module}:partial_length", glob)
    with pytest.raises(FunctionError, match="has no 'nope'"):
        load(f"{module}:nope", glob)
    assert load(f"{module}:partial_length", f"{module}:partial_length")(prompts=[], completions=["ab"]) == [2]
    with pytest.raises(FunctionError, match="not callable"):
        load(f"{module}:NOT_CALLABLE", f"{module}:NOT_CALLABLE")
    with pytest.raises(FunctionError, match="cannot import"):
        load("no_such_module_at_all:f", "no_such_module_at_all:*")
    assert resolve(f"{module}:length", glob) == f"{module}:length(prompts, completions, **kwargs)"


def test_call_passes_trl_keywords_and_summarises_errors(module):
    rewards, parts = call(f"{module}:scaled", f"{module}:*", ["p1", "p2"], ["a", "b"], {"solution": ["a", "x"]},
                          {"scale": 0.5})
    assert rewards == [0.5, 0.0] and parts == {}
    with pytest.raises(FunctionError, match=r"KeyError: 'missing' \(rewards_\w+\.py:10 in boom\)"):
        call(f"{module}:boom", f"{module}:*", ["p"], ["c"], {}, {})
    with pytest.raises(FunctionError, match="TypeError"):  # the line lacks the column the function needs
        call(f"{module}:scaled", f"{module}:*", ["p"], ["c"], {}, {})


def test_results_are_lists_of_numbers_or_none():
    assert normalise([1, 0.5, True, None, np.float32(0.25)], 5) == ([1.0, 0.5, 1.0, None, 0.25], {})
    assert normalise(np.array([1.0, math.nan]), 2) == ([1.0, None], {})  # NaN is no reward, as in TRL
    for bad, why in [([1.0], "has 1 values for 2"), ("ab", "expected a list"), (3.0, "expected a list"),
                     ([1.0, "1"], r"\[1\] is str"), ([1.0, math.inf], "must be finite"), (iter([1, 2]), "expected a list")]:
        with pytest.raises(FunctionError, match=why):
            normalise(bad, 2)


def test_named_components_are_summed_without_nones():
    rewards, parts = normalise({"format": [1.0, None, None], "accuracy": [0.5, 1.0, None]}, 3)
    assert rewards == [1.5, 1.0, None]
    assert parts == {"format": [1.0, None, None], "accuracy": [0.5, 1.0, None]}
    for bad, why in [({}, "0 components"), ({"Bad-Name": [1.0]}, "component name"), ({"ok": [1.0, 2.0]}, "has 2 values"),
                     ({f"c{i}": [1.0] for i in range(17)}, "17 components")]:
        with pytest.raises(FunctionError, match=why):
            normalise(bad, 1)
