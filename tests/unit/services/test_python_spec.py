"""The ``python`` reward spec on a prompt-set line: its fields become the function's keywords, its names
are checked where the line is read, and a template line's fields reach the function too."""

from __future__ import annotations

import json

import pytest

from services.config import parse_run_config
from services.prompt_forms import prompt_forms
from services.prompt_lines import LineError, LineParser, line_specs
from services.reward_specs import PythonSpec


def stored(*lines: dict, default_type: str = "math") -> list[dict]:
    parser = LineParser(default_type)
    parser.feed(("\n".join(json.dumps(x) for x in lines) + "\n").encode())
    return parser.finish()


def config(**sections):
    return parse_run_config({"model": {"path": "/nowhere"}, "data": {"train": "/t.jsonl"}, **sections})


def test_the_lines_other_fields_are_the_functions_keywords():
    [line] = stored({"prompt": "6 x 7?", "type": "python", "function": "my_rewards:match", "solution": "42",
                     "tags": ["arith"], "args": {"scale": 0.5}})
    assert line["spec"] == {"type": "python", "function": "my_rewards:match", "args": {"scale": 0.5},
                            "kwargs": {"solution": "42", "tags": ["arith"]}}
    [spec] = line_specs([line], config())
    assert spec == PythonSpec(function="my_rewards:match", args={"scale": 0.5}, kwargs={"solution": "42", "tags": ["arith"]})
    assert PythonSpec.model_validate(spec.model_dump()) == spec  # the stored and wire forms read back the same


def test_bad_names_are_refused_naming_the_line_and_field():
    with pytest.raises(LineError) as e:
        stored({"prompt": "a", "type": "python", "function": "os.system"},
               {"prompt": "b", "type": "python", "function": "m:f", "completions": ["x"]},
               {"prompt": "c", "type": "python", "function": "m:f", "x": 1, "args": {"x": 2}},
               {"prompt": "d", "type": "python", "function": "m:f:g"},
               {"prompt": "e", "type": "combined", "parts": [{"weight": 1, "spec": {"type": "python", "function": "1m:f"}}]})
    got = [(x["line"], x["field"], x["msg"]) for x in e.value.errors]
    assert got[0][:2] == (1, "function") and "module:name" in got[0][2]
    assert got[1][0] == 2 and "'completions' is a keyword TRL passes itself" in got[1][2]
    assert got[2][0] == 3 and "'x' is both in args and a field of the line" in got[2][2]
    assert got[3][:2] == (4, "function")
    assert got[4][0] == 5 and got[4][1].startswith("parts.0.spec") and got[4][1].endswith("function")


def test_a_template_lines_fields_reach_the_function_and_are_not_unknown():
    line = {"question": "6 x 7?", "solution": "42", "type": "python", "function": "my_rewards:match"}
    lines = stored(line)
    run = config(prompt={"template": "Q: {question}\nA:"})
    [spec] = line_specs(lines, run)
    assert spec.kwargs == {"question": "6 x 7?", "solution": "42"}  # every field, as TRL passes every column
    assert prompt_forms(lines, run, chat=False)[0].prompt == "Q: 6 x 7?\nA:"
    # the same field under a built-in reward is nobody's: an error naming it
    math = stored({"question": "6 x 7?", "solution": "42", "type": "math", "answer": "42"})
    with pytest.raises(LineError) as e:
        prompt_forms(math, run, chat=False)
    assert [(x["line"], x["field"]) for x in e.value.errors] == [(1, "solution")]
