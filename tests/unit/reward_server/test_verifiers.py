"""Answer extraction, the text verifiers and the python_tests verdict logic (no sandbox needed)."""

from __future__ import annotations

import pytest

from reward_server import extract
from reward_server.sandbox.base import RunOutcome
from reward_server.verifiers import code, text
from services.reward_specs import ExactSpec, IOCase, NumericSpec, PythonTestsSpec, RegexSpec


def test_boxed_balances_braces_and_takes_the_last():
    assert extract.boxed(r"first \boxed{1} then \boxed{\frac{a}{b^{2}}} done") == r"\frac{a}{b^{2}}"
    assert extract.boxed(r"\boxed{unclosed") is None
    assert extract.extract(r"\fbox{7}", "boxed") == "7"


def test_answer_tag_last_number_and_whole():
    assert extract.extract("<answer>1</answer> no <ANSWER> 2 </ANSWER>", "answer_tag") == "2"
    assert extract.extract("<answer>  </answer>", "answer_tag") is None
    assert extract.extract("pay 1,250.50 or -3", "last_number") == "-3"
    assert extract.extract("total 1,250.50", "last_number") == "1250.50"
    assert extract.extract("no digits", "last_number") is None
    assert extract.extract("  all of it \n", "whole") == "all of it"


def test_code_prefers_the_last_python_block():
    completion = "```python\nold()\n```\ntext\n```python\nnew()\n```\n```\nnot python\n```"
    assert extract.code(completion) == "new()\n"
    assert extract.code("```\nplain()\n```") == "plain()\n"
    assert extract.code("```python\nunterminated()\n") == "unterminated()\n"
    assert extract.code("no fences") is None
    assert extract.code("no fences", "whole") == "no fences"


@pytest.mark.parametrize(("completion", "spec", "expected"), [
    ("<answer>Paris</answer>", ExactSpec(answer="Paris"), (1.0, "ok")),
    ("<answer>paris</answer>", ExactSpec(answer="Paris"), (0.0, "wrong_answer")),
    ("<answer>paris</answer>", ExactSpec(answer="Paris", case_sensitive=False), (1.0, "ok")),
    ("nothing", ExactSpec(answer="Paris"), (0.0, "no_answer")),
    ("x = 3.1416", NumericSpec(answer=3.14159, tolerance=1e-3), (1.0, "ok")),
    ("x = 3.2", NumericSpec(answer=3.14159, tolerance=1e-3), (0.0, "wrong_answer")),
    ("<answer>1e400</answer>", NumericSpec(answer=1.0, extract="answer_tag"), (0.0, "wrong_answer")),
    ("<answer>abc</answer>", NumericSpec(answer=1.0, extract="answer_tag"), (0.0, "wrong_answer")),
    ("102", NumericSpec(answer=100, tolerance=0.05, relative=True), (1.0, "ok")),
])
def test_exact_and_numeric(completion, spec, expected):
    verify = text.exact if spec.type == "exact" else text.numeric
    result = verify("i", completion, spec)
    assert (result.reward, result.status) == expected


async def test_regex_modes():
    assert (await text.regex("i", "<a>x</a>", RegexSpec(pattern="<a>.*</a>", mode="fullmatch"))).reward == 1.0
    assert (await text.regex("i", "say <a>x</a>", RegexSpec(pattern="<a>.*</a>", mode="fullmatch"))).reward == 0.0
    assert (await text.regex("i", "say <a>x</a>", RegexSpec(pattern="<a>.*</a>"))).reward == 1.0
    assert (await text.regex("i", "<a>\nx</a>", RegexSpec(pattern="^<a>.*</a>$"))).reward == 1.0  # DOTALL


async def test_regex_backtracking_ends_in_timeout_within_the_bound():
    import time

    t0 = time.monotonic()
    slow = await text.regex("i", "a" * 60 + "b", RegexSpec(pattern="(a|aa)+$"), timeout_s=0.3)
    assert (slow.reward, slow.status) == (0.0, "timeout") and "0.3 s" in slow.detail
    assert time.monotonic() - t0 < 5
    # re backtracks on this one for hours; regex answers at once
    nested = await text.regex("i", "a" * 40 + "b", RegexSpec(pattern="(a+)+$"), timeout_s=0.3)
    assert (nested.reward, nested.status) == (0.0, "wrong_answer")


async def test_last_match_is_the_last_and_bounded():
    found = await text.last_match(r"Score:\s*(\d+)", "Score: 10 ... Score: 3", timeout_s=1)
    assert found is not None and found.group(1) == "3"
    assert await text.last_match(r"x", "abc", timeout_s=1) is None
    with pytest.raises(TimeoutError):  # millions of quick matches still share one deadline
        await text.last_match(r"a", "a" * 3_000_000, timeout_s=0.2)


def outcome(status="ok", stdout="", results=None) -> RunOutcome:
    return RunOutcome(status=status, detail="", exit_code=0, stdout=stdout, stderr="", wall_s=0.1, cpu_s=0.1,
                      truncated=False, results=results)


def test_python_tests_verdicts():
    spec = PythonTestsSpec(tests=["t0", "t1"], io=[IOCase(stdin="", stdout="a\nb")])
    job = code.build_job("print(1)", spec, "/usr/bin/python3")
    assert [r.results for r in job.runs] == [True, False] and set(job.files) == {"solution.py"}
    passed = [{"i": 0, "ok": True}, {"i": 1, "ok": True}]
    assert code.judge(spec, [outcome(results=passed), outcome(stdout="a  \nb\n\n")]) == (1.0, "ok", "")
    reward, status, _ = code.judge(spec, [outcome(results=passed[:1]), outcome(stdout="a\nc")])
    assert (reward, status) == (pytest.approx(1 / 3), "wrong_answer")
    reward, status, _ = code.judge(spec, [outcome("timeout", results=passed[:1]), outcome("memory_limit")])
    assert (reward, status) == (pytest.approx(1 / 3), "timeout")
    strict = spec.model_copy(update={"reward_mode": "all"})
    assert code.judge(strict, [outcome(results=passed), outcome(stdout="x")])[0] == 0.0
