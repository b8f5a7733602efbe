"""The episode tools' pure parts (rollout_server.tools): the call format, the calculator, the observation,
user-tool loading. The tools against real sandboxes and the engine: tests/integration/rollout_server."""

from __future__ import annotations

import pytest

from rollout_server.tool_pool import ToolPool, import_tools
from rollout_server.tools import (
    MAX_OBSERVATION_CHARS,
    Call,
    ToolBox,
    ToolError,
    ToolLimits,
    calculate,
    check_user_tools,
    observation,
    parse_call,
)


@pytest.mark.parametrize(("expression", "value"), [
    ("123+456", "579"), ("2**10", "1024"), ("7/2", "3.5"), ("(1+2)*3-4", "5"), ("-3 + +4", "1"),
    ("10//3", "3"), ("10 % 4", "2"), ("6/3", "2"), ("2**0.5", "1.41421356237"), ("  999*999 ", "998001"),
    ("(" * 90 + "1" + ")" * 90, "1"),
])
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "words"), [
    ("1/0", "division by zero"),
    ("9**9**9", "too large"),
    ("10**400", "too large"),
    ("1e308*10", "out of range"),
    ('__import__("os").system("true")', "not Call"),
    ("x+1", "not Name"),
    ("(1).real", "not Attribute"),
    ("[1]*3", "not List"),
    ("True+1", "not Constant"),
    ("'a'*3", "not Constant"),
    ("", "not an arithmetic expression"),
    ("1+", "not an arithmetic expression"),
    ("(" * 90 + ")" * 90, "not Tuple"),
    ("1+" * 150 + "1", "longer than 200"),
])
def test_the_calculator_refuses_anything_else(expression, words):
    with pytest.raises(ToolError, match=words.replace("(", r"\(")):
        calculate(expression)


@pytest.mark.parametrize(("text", "call"), [
    ("the sum is 3", None),
    ("done</tool> and more", None),
    ("let me add <tool>calculator: 12 + 30</tool>", Call("calculator", "12 + 30")),
    ("<tool> python :x = 1\nprint(x)\n</tool>\n", Call("python", "x = 1\nprint(x)")),
    ("<tool>a: 1</tool> <tool>calculator: 2</tool>", Call("calculator", "2")),
    ("<tool>calculator</tool>", Call(error="malformed call: write <tool>NAME: ARGS</tool>, NAME a tool's name")),
    ("<tool>Calc: 1</tool>", Call(error="malformed call: write <tool>NAME: ARGS</tool>, NAME a tool's name")),
    ("1+1 =</tool>", Call(error="malformed call: </tool> without <tool>")),
])
def test_a_turn_ends_with_a_call_or_not(text, call):
    assert parse_call(text) == call


def test_an_observation_is_tagged_and_cut():
    assert observation("42", error=False) == "<result>42</result>"
    assert observation("no", error=True) == "<error>no</error>"
    long = observation("x" * 5000, error=False)
    assert long == "<result>" + "x" * MAX_OBSERVATION_CHARS + "...</result>"


def test_user_tools_are_named_module_functions():
    named = check_user_tools({"reverse": "tests.episode_tools:reverse"})
    assert ToolBox(user=ToolPool(named)).names() == {"calculator", "reverse"}
    assert ToolBox(user=ToolPool(named)).unknown(["reverse", "python", "nope"]) == ["python", "nope"]
    for named, words in [({"Reverse": "tests.episode_tools:reverse"}, "must match"),
                         ({"python": "tests.episode_tools:reverse"}, "must match"),
                         ({"r": "tests.episode_tools"}, "not 'module:function'")]:
        with pytest.raises(ValueError, match=words):
            check_user_tools(named)
    assert import_tools({"reverse": "tests.episode_tools:reverse"})["reverse"]("abc") == "cba"
    for named, words in [({"r": "tests.episode_tools:absent"}, "cannot import"),
                         ({"r": "tests.no_such_module:f"}, "cannot import"),
                         ({"r": "tests.episode_tools:NOT_A_FUNCTION"}, "not a function")]:
        with pytest.raises(ValueError, match=words):
            import_tools(named)


@pytest.mark.parametrize(("line_s", "server_s", "bound"), [
    (None, 300.0, (300.0, "TANDEM_ROLLOUT_TOOL_EPISODE_S")),
    (20.0, 300.0, (20.0, "episode.tool_budget_s")),
    (900.0, 300.0, (300.0, "TANDEM_ROLLOUT_TOOL_EPISODE_S")),  # a line cannot raise the server's
])
def test_an_episodes_tool_time_is_the_lines_at_most_the_servers(line_s, server_s, bound):
    s = ToolBox(limits=ToolLimits(call_s=60, episode_s=server_s)).session(line_s)
    assert (s.budget_s, s.budget_field) == bound
