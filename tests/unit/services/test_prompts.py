"""Prompt forms (services.prompt_forms, services.prompt_lines): messages, template fields, the system prompt,
and whether a model directory has a chat template, checked against transformers' own loading."""

from __future__ import annotations

import json
import shutil

import pytest

from services.config import ConfigError, parse_run_config
from services.prompt_forms import chat_template_in, prompt_forms
from services.prompt_lines import LineError, LineParser
from services.wire import Message

CHAT = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def stored(*lines: dict, default_type: str = "math") -> list[dict]:
    parser = LineParser(default_type)
    parser.feed(("\n".join(json.dumps(x) for x in lines) + "\n").encode())
    return parser.finish()


def config(**prompt):
    return parse_run_config({"model": {"path": "/nowhere"}, "data": {"train": "/t.jsonl"}, "prompt": prompt})


def errors(e: LineError) -> list[tuple[int, str]]:
    return [(x["line"], x["field"]) for x in e.errors]


# -- the line format ---------------------------------------------------------------------------------


def test_a_line_keeps_its_prompt_form_beside_its_spec_and_the_set_counts_the_forms():
    parser = LineParser("math")
    lines = [
        {"prompt": "2+2=", "answer": "4"},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"}], "answer": "4"},
        {"question": "2+2?", "answer": "4"},
        {"question": "3+3?", "n": 2, "type": "exact", "answer": "6"},
    ]
    parser.feed("\n".join(json.dumps(x) for x in lines).encode())
    out = parser.finish()
    assert out[0] == {"prompt": "2+2=", "fields": {"answer": "4"}}
    assert out[1]["messages"] == lines[1]["messages"] and out[1]["fields"] == {"answer": "4"}
    assert out[2] == {"inputs": {"question": "2+2?"}, "fields": {"answer": "4"}}
    assert out[3]["inputs"] == {"question": "3+3?", "n": 2} and out[3]["spec"]["answer"] == "6"
    assert parser.forms == {"prompt": 1, "messages": 1, "template": 2}


@pytest.mark.parametrize("line, field", [
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x", "answer": "1"}, "messages"),
    ({"messages": [{"role": "bot", "content": "hi"}], "answer": "1"}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}], "answer": "1"}, "messages.0.name"),
    ({"messages": [{"role": "user"}], "answer": "1"}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"},
     "messages"),
    ({"messages": [], "answer": "1"}, "messages"),
    ({"messages": "hi", "answer": "1"}, "messages"),
    ({"answer": "1"}, "prompt"),
    ({"prompt": None, "question": "q", "answer": "1"}, "prompt"),
    ({"question": ["a"], "answer": "1"}, "question"),
    ({"question": True, "answer": "1"}, "question"),
])
def test_a_bad_prompt_form_is_refused_at_upload_naming_the_field(line, field):
    with pytest.raises(LineError) as e:
        stored(line)
    assert (1, field) in errors(e.value), e.value.errors


# -- what a run makes of the lines ---------------------------------------------------------------------


def test_without_a_prompt_section_prompt_and_messages_lines_pass_through():
    lines = stored({"prompt": "2+2=", "answer": "4"},
                   {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"})
    forms = prompt_forms(lines, config(), chat=True)
    assert forms[0].prompt == "2+2=" and forms[0].messages is None
    assert forms[1].messages == (Message(role="user", content="2+2?"),)


def test_the_template_is_filled_from_each_lines_fields_and_never_from_the_spec():
    lines = stored({"question": "2+2?", "topic": "sums", "answer": "4"}, {"prompt": "3+3?", "answer": "6"})
    with pytest.raises(LineError) as e:
        prompt_forms(lines, config(template="[{topic}] Question: {question}\nAnswer:"), chat=False)
    # line 2 is a prompt line: it has no question or topic, and the template drops its prompt
    assert sorted(errors(e.value)) == [(2, "prompt"), (2, "question"), (2, "topic")]
    assert "prompt.template uses {question}" in str(e.value)
    forms = prompt_forms(lines[:1], config(template="[{topic}] Question: {question}\nAnswer:"), chat=False)
    assert forms[0].prompt == "[sums] Question: 2+2?\nAnswer:"
    # the answer is a spec field: a template cannot reach it
    with pytest.raises(LineError) as e:
        prompt_forms(lines[:1], config(template="{question} {topic} {answer}"), chat=False)
    assert errors(e.value) == [(1, "answer")]


def test_a_field_the_template_does_not_use_is_an_error_naming_it():
    lines = stored({"question": "2+2?", "qestion_id": 7, "answer": "4"})
    with pytest.raises(LineError) as e:
        prompt_forms(lines, config(template="Q: {question}"), chat=None)
    assert errors(e.value) == [(1, "qestion_id")] and "unknown field" in str(e.value)


def test_a_template_line_needs_a_template():
    with pytest.raises(LineError) as e:
        prompt_forms(stored({"question": "2+2?", "answer": "4"}), config(), chat=None)
    assert errors(e.value) == [(1, "prompt")] and "question" in str(e.value)


def test_a_prompt_line_is_filled_in_as_prompt_and_numbers_as_text():
    lines = stored({"prompt": "2+2", "answer": "4"}, {"a": 12, "b": 1.5, "answer": "x"})
    assert prompt_forms(lines[:1], config(template="Q: {prompt}\nA:"), chat=None)[0].prompt == "Q: 2+2\nA:"
    assert prompt_forms(lines[1:], config(template="{a} and {b}"), chat=None)[0].prompt == "12 and 1.5"


def test_the_system_prompt_goes_first_unless_a_messages_line_has_its_own():
    lines = stored({"messages": [{"role": "user", "content": "hi"}], "answer": "1"},
                   {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}],
                    "answer": "1"},
                   {"prompt": "2+2?", "answer": "4"})
    forms = prompt_forms(lines, config(system_prompt="Be brief."), chat=True)
    system = Message(role="system", content="Be brief.")
    assert forms[0].messages == (system, Message(role="user", content="hi"))
    assert forms[1].messages[0].content == "mine" and len(forms[1].messages) == 2
    assert forms[2].messages == (system, Message(role="user", content="2+2?"))  # a prompt line becomes a chat
    assert prompt_forms(lines[2:], config(system_prompt="Be brief."), chat=None)[0].messages is not None


def test_a_model_without_a_chat_template_refuses_messages_and_a_system_prompt_for_prompt_lines():
    lines = stored({"prompt": "2+2?", "answer": "4"}, {"messages": [{"role": "user", "content": "hi"}], "answer": "1"})
    with pytest.raises(LineError) as e:
        prompt_forms(lines, config(), chat=False)
    assert errors(e.value) == [(2, "messages")] and "no chat template" in str(e.value)
    with pytest.raises(LineError) as e:
        prompt_forms(lines[:1], config(system_prompt="Be brief."), chat=False)
    assert errors(e.value) == [(0, "prompt.system_prompt")]
    assert prompt_forms(lines[:1], config(system_prompt="Be brief.", template="Be brief. {prompt}"), chat=True)


@pytest.mark.parametrize("prompt, field", [
    ({"template": "{}"}, "prompt.template"),
    ({"template": "{q.__class__}"}, "prompt.template"),
    ({"template": "{q!r}"}, "prompt.template"),
    ({"template": "no placeholder"}, "prompt.template"),
    ({"template": "{unclosed"}, "prompt.template"),
    ({"system_prompt": ""}, "prompt.system_prompt"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "prompt.chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": [1]}}, "prompt.chat_template_kwargs"),
    ({"sytem_prompt": "x"}, "prompt.sytem_prompt"),
])
def test_a_bad_prompt_section_fails_at_load_naming_the_field(prompt, field):
    with pytest.raises(ConfigError) as e:
        config(**prompt)
    assert f"<config>: {field}" in str(e.value)


def test_chat_template_kwargs_keep_their_types():
    assert config(chat_template_kwargs={"enable_thinking": False, "n": 2}).prompt.chat_template_kwargs == {
        "enable_thinking": False, "n": 2}


# -- does the model have a chat template? ------------------------------------------------------------


def _layouts(base):
    """Tokenizer folders in every way transformers stores (or stored) a chat template."""
    from examples.tiny import char_tokenizer

    plain = base / "plain"
    char_tokenizer().save_pretrained(plain)
    made = {"plain": plain}

    def variant(name, template_file=None, config_template=None, extra=None):
        d = base / name
        shutil.copytree(plain, d)
        if template_file is not None:
            (d / "chat_template.jinja").write_text(template_file)
        if config_template is not None:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["chat_template"] = config_template
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        for template_name in extra or []:
            (d / "additional_chat_templates").mkdir(exist_ok=True)
            (d / "additional_chat_templates" / f"{template_name}.jinja").write_text(CHAT)
        made[name] = d

    variant("jinja_file", template_file=CHAT)
    variant("in_config", config_template=CHAT)
    variant("named_with_default", config_template=[{"name": "default", "template": CHAT},
                                                   {"name": "tool_use", "template": CHAT}])
    variant("named_without_default", config_template=[{"name": "tool_use", "template": CHAT}])
    variant("extra_files_only", extra=["tool_use"])
    variant("extra_files_and_default", template_file=CHAT, extra=["tool_use"])
    variant("extra_default_file", extra=["default"])
    variant("files_replace_config", config_template=CHAT, extra=["tool_use"])
    return made


def test_chat_template_in_agrees_with_transformers_for_every_layout(tmp_path):
    from transformers import AutoTokenizer

    seen = {}
    for name, d in _layouts(tmp_path).items():
        tok = AutoTokenizer.from_pretrained(d)
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
            truth = True
        except ValueError:  # "Cannot use chat template functions because tokenizer.chat_template is not set ..."
            truth = False
        seen[name] = chat_template_in(d)
        assert seen[name] is truth, (name, seen[name], truth)
    assert sorted(k for k, v in seen.items() if v) == [
        "extra_default_file", "extra_files_and_default", "in_config", "jinja_file", "named_with_default"]


def test_chat_template_in_is_unknown_where_no_model_is_to_be_seen(tmp_path):
    assert chat_template_in(tmp_path / "missing") is None
    assert chat_template_in(tmp_path) is None  # an empty folder: the model is not built yet
    (tmp_path / "config.json").write_text("{}")
    assert chat_template_in(tmp_path) is False  # a model without tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert chat_template_in(tmp_path) is None
