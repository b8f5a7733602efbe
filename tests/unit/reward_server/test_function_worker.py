"""The reward-function worker's pure parts: the allow-list match, loading by name, what a result may be."""

from __future__ import annotations

import math
import re
import time
import uuid

import numpy as np
import pytest

from reward_server.verifiers.function_worker import (
    Call,
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
        "def progress(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):\n"
        "    log_metric('calls', 1.0)\n"
        "    log_extra('ids', [len(i) for i in completion_ids])\n"
        "    return [trainer_state.global_step / trainer_state.max_steps + trainer_state.epoch] * len(completions)\n"
        "async def later(prompts, completions, **kwargs):\n"
        "    import asyncio\n"
        "    await asyncio.sleep(0.2)\n"
        "    return [1.0] * len(completions)\n"
        "def only_positional(prompts, /, completions, **kwargs):\n"
        "    return [0.0] * len(completions)\n"
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
    length = resolve(f"{module}:length", glob)
    assert length.signature == f"{module}:length(prompts, completions, **kwargs)"
    assert length.required == ("prompts", "completions") and not length.is_async
    assert resolve(f"{module}:scaled", glob).required == ("prompts", "completions", "solution")
    assert resolve(f"{module}:later", glob).is_async
    assert resolve(f"{module}:only_positional", glob).required == ("/prompts", "completions")


def one(module, name, completions, columns=None, args=None, ids=None, state=None) -> Call:
    return Call(f"{module}:{name}", f"{module}:*", ["p"] * len(completions), completions, ids, columns or {},
                args or {}, state)


def test_call_passes_trl_keywords_and_summarises_errors(module):
    (scaled, boom, lacking) = call([one(module, "scaled", ["a", "b"], {"solution": ["a", "x"]}, {"scale": 0.5}),
                                    one(module, "boom", ["c"]), one(module, "scaled", ["c"])])
    assert scaled.rewards == [0.5, 0.0] and scaled.components == {} and not scaled.error
    assert re.search(r"KeyError: 'missing' \(rewards_\w+\.py:10 in boom\)", boom.error)
    assert "TypeError" in lacking.error  # the line lacks the column the function needs


def test_call_passes_trainer_state_and_completion_ids_and_keeps_what_is_logged(module):
    (out,) = call([one(module, "progress", ["a", "b"], ids=[[1, 2], [3]],
                       state={"global_step": 3, "max_steps": 4, "epoch": 1.0})])
    assert out.rewards == [1.75, 1.75]
    assert out.logged.extra == {"ids": [2, 1]} and out.logged.metrics == {"calls": [1.0]}


def test_async_functions_are_awaited_together(module):
    t0 = time.monotonic()
    outs = call([one(module, "later", ["a"]), one(module, "later", ["b", "c"]), one(module, "length", ["abc"])])
    assert [o.rewards for o in outs] == [[1.0], [1.0, 1.0], [3.0]]
    assert time.monotonic() - t0 < 0.35  # two 0.2 s sleeps, awaited concurrently


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
