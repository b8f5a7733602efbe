"""Prompt-set parsing and the prompt groups a run enqueues (no Redis)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from control_plane.groups import build_groups, epoch_order
from services.config import parse_run_config
from services.prompt_lines import ANSWER_TAG, MAX_ERRORS, LineError, LineParser

LINES = [{"prompt": f"{i}+1=", "type": "exact", "answer": str(i + 1)} for i in range(10)]
BODY = "".join(json.dumps(x) + "\n" for x in LINES).encode()


def parse(body: bytes, chunk: int | None = None, default_type: str = "math") -> LineParser:
    parser = LineParser(default_type)
    step = chunk or max(1, len(body))
    for i in range(0, len(body), step):
        parser.feed(body[i : i + step])
    parser.finish()
    return parser


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, None])
def test_lines_survive_any_chunking(chunk):
    body = BODY.replace(b'"0+1="', '"zéro+1 ✓="'.encode())  # multi-byte characters split across chunks
    parser = parse(body, chunk)
    assert [x["prompt"] for x in parser.lines][:2] == ["zéro+1 ✓=", "1+1="]
    assert len(parser.lines) == 10 and parser.nbytes == len(body) and parser.types == {"exact": 10}


def test_crlf_bom_blank_lines_and_no_final_newline():
    body = b"\xef\xbb\xbf" + BODY.replace(b"\n", b"\r\n\r\n").rstrip()
    assert len(parse(body).lines) == 10


def test_stored_form_is_the_validated_spec():
    line = parse(BODY).lines[0]
    assert line["spec"] == {"type": "exact", "answer": "1", "extract": "answer_tag", "case_sensitive": True, "strip": True}


def test_untyped_lines_keep_their_fields_for_the_run_config():
    parser = parse(b'{"prompt": "p", "answer": "4"}\n')
    assert parser.lines == [{"prompt": "p", "fields": {"answer": "4"}}] and parser.types == {"default": 1}
    with pytest.raises(LineError, match="line 1: pattern: Field required"):
        parse(b'{"prompt": "p", "answer": "4"}\n', default_type="regex")


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"prompt": "p", "type": "exact"}', "line 1: answer: Field required"),
        (b'{"prompt": ["p"], "type": "exact", "answer": "1"}', "line 1: prompt: must be a non-empty string"),
        (b'{"prompt": "", "type": "exact", "answer": "1"}', "line 1: prompt: must be a non-empty string"),
        (b'{"prompt": "p", "type": "exact", "answer": "1", "case_sensitive": "maybe"}', "line 1: case_sensitive: Input should be a valid boolean"),
        (b'{"prompt": "p", "type": "python_tests"}', "line 1: spec: Value error, python_tests needs at least one"),
        (b'{"prompt": "p", "type": "combined", "parts": [{"weight": 1, "spec": {"type": "nope"}}]}', "line 1: parts.0.spec.type: unknown reward type"),
        (b'{"prompt": "p", "type": 3}', "line 1: type: unknown reward type"),
        (b"\n\n" + b'{"prompt": "p"', "line 3: invalid JSON"),
        (b'"just a string"', "line 1: expected a JSON object"),
        (b"\xc3\x28", "line 1: not valid UTF-8 (byte 0)"),
        (b"", "the prompt set is empty"),
    ],
)
def test_bad_lines_name_line_and_field(body, message):
    with pytest.raises(LineError) as info:
        parse(body)
    assert message in str(info.value)


def test_parsing_stops_after_max_errors():
    parser = LineParser()
    with pytest.raises(LineError) as info:
        for _ in range(10 * MAX_ERRORS):
            parser.feed(b"{}\n")
    assert {e["line"] for e in info.value.errors} == set(range(1, MAX_ERRORS // 2 + 1))
    assert len(info.value.errors) == MAX_ERRORS  # two problems a line: prompt and type


def config(**sections) -> object:
    base = {"model": {"path": "m"}, "data": {"train": "t", "epochs": 3, "shuffle_seed": 5}, "sampling": {"group_size": 6}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return parse_run_config(base)


def test_groups_cover_every_line_every_epoch_in_a_seeded_order():
    lines = parse(BODY).lines
    groups = build_groups("run-1", lines, config())
    assert len(groups) == 30 and len({g.group_id for g in groups}) == 30
    orders = [[g.index for g in groups if g.epoch == e] for e in range(3)]
    assert all(sorted(o) == list(range(10)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # reshuffled each epoch
    assert orders == [epoch_order(10, e, 5) for e in range(3)]  # deterministic from the seed
    assert build_groups("run-1", lines, config()) == groups
    g = groups[0]
    assert (g.run_id, g.n, g.group_id, g.prompt) == ("run-1", 6, f"e0-{g.index}", LINES[g.index]["prompt"])


def test_no_shuffle_seed_keeps_file_order():
    groups = build_groups("r", parse(BODY).lines, config(data={"shuffle_seed": None}))
    assert [g.index for g in groups[:10]] == list(range(10))


def test_format_weight_adds_the_answer_tag_reward():
    spec = build_groups("r", parse(BODY).lines, config(reward={"format_weight": 0.5}))[0].spec
    assert spec.type == "combined"
    assert spec.parts[1].weight == 0.5 and spec.parts[1].spec.pattern == ANSWER_TAG
    assert spec.parts[0].spec.type == "exact"


def test_untyped_lines_take_the_config_type_and_extract():
    lines = parse(b'{"prompt": "p", "answer": "4"}\n').lines
    spec = build_groups("r", lines, config(reward={"type": "numeric", "extract": "boxed"}))[0].spec
    assert (spec.type, spec.answer, spec.extract) == ("numeric", 4.0, "boxed")
    with pytest.raises(LineError, match="line 1: answer: Input should be a valid number"):
        build_groups("r", parse(b'{"prompt": "p", "answer": "four"}\n').lines, config(reward={"type": "numeric"}))


def test_control_plane_and_run_registry_import_light():
    code = (
        "import sys, control_plane, control_plane.app, services.runs\n"
        "heavy = [m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
