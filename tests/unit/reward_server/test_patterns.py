"""Untrusted text meets patterns: extraction stays linear on hostile completions, and the wire
types bound what a prompt set's regular expressions and judge URLs may be."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from reward_server import extract
from services.reward_specs import MAX_PATTERN_CHARS, JudgeSpec, RegexSpec

# The extraction regexes as they were (quadratic on hostile input): the reference semantics.
OLD_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
OLD_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def old_boxed(text: str) -> str | None:
    for start in reversed([m.end() for m in extract.BOXED.finditer(text)]):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


PIECES = ["<answer>", "</answer>", "<ANSWER>", "```", "```python\n", "```py x\n", "\n", "{", "}", "\\boxed{",
          "\\fbox {", "a", " ", "1"]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14).map("".join))
def test_scanning_extractors_agree_with_the_regexes(text):
    found = OLD_ANSWER_TAG.findall(text)
    assert extract.answer_tag(text) == (found[-1].strip() if found else None)
    assert extract.fenced_blocks(text) == OLD_FENCE.findall(text)
    assert extract.boxed(text) == old_boxed(text)


HOSTILE = {
    "answer_tag": "<answer>" * 25_000,
    "boxed": "\\boxed{" * 30_000,
    "fence": "```" + "a" * 200_000,
    "fences": "```" * 70_000,
    "number": "1," * 100_000,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_extraction_is_linear_on_hostile_completions(name):
    text = HOSTILE[name]
    t0 = time.monotonic()
    for mode in ("answer_tag", "boxed", "last_number"):
        extract.extract(text, mode)
    extract.code(text)
    assert time.monotonic() - t0 < 2.0  # the lazy regexes took minutes on these (quadratic)


def test_patterns_are_bounded_in_length_and_expansion():
    with pytest.raises(ValidationError, match="pattern"):
        RegexSpec(pattern="a" * (MAX_PATTERN_CHARS + 1))
    with pytest.raises(ValidationError, match="score_pattern"):
        JudgeSpec(score_pattern="a" * (MAX_PATTERN_CHARS + 1))
    for huge in ("(?:a{1000}){1000}", "((((x{100}){100}){100}){100})", "a{200000}", "(?=b{99999}c{99999})"):
        with pytest.raises(ValidationError, match="counted repeats"):
            RegexSpec(pattern=huge)
    RegexSpec(pattern=r"^<think>.{1,2000}</think>\s*<answer>\d{1,6}</answer>$")  # ordinary ones pass
    RegexSpec(pattern="(?:a{100}){1000}")  # exactly at the bound


@pytest.mark.parametrize("url", ["ftp://judge", "judge:8000", "http://user:pw@judge", "http://judge/?k=v",
                                 "http://judge#x", "http://judge:70000", "http:///v1"])
def test_judge_url_must_be_a_plain_http_base(url):
    with pytest.raises(ValidationError, match="url"):
        JudgeSpec(url=url)
    assert JudgeSpec(url="https://judge.example:8443/api/").url == "https://judge.example:8443/api/"
