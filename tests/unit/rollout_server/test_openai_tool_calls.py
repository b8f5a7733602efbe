"""The chat route's tool calls: Hermes ``<tool_call>`` blocks naming a declared tool become OpenAI tool calls
(``rollout_server.openai_api.parse_tool_calls``); anything else stays text."""

from __future__ import annotations

import json

from rollout_server.openai_api import ChatMessage, ToolSpec, parse_tool_calls

TOOLS = [ToolSpec(type="function", function={"name": "add", "parameters": {"type": "object"}}),
         ToolSpec(type="function", function={"name": "mul"})]


def test_blocks_become_calls_and_the_rest_is_content():
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and <tool_call>' \
           '{"name": "mul", "arguments": "{\\"a\\": 3}"}</tool_call>'
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me add.  and"
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[1]["function"]["arguments"] == '{"a": 3}'  # a string stays as sent
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_only_calls_leave_no_content():
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>', TOOLS)[0] is None


def test_malformed_or_undeclared_blocks_stay_text():
    for text in ['<tool_call>{"name": "add", </tool_call>', '<tool_call>{"name": "sub", "arguments": {}}</tool_call>',
                 '<tool_call>["add"]</tool_call>', "no call at all", '<tool_call>{"name": "add"}']:
        assert parse_tool_calls(text, TOOLS) == (text, [])


def test_messages_reach_the_template_as_it_expects():
    m = ChatMessage(role="assistant", content=None,
                    tool_calls=[{"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}])
    assert m.for_template() == {"role": "assistant", "content": "",
                                "tool_calls": [{"id": "c1", "type": "function",
                                                "function": {"name": "add", "arguments": {"a": 1}}}]}
    parts = ChatMessage(role="developer", content=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}])
    assert parts.for_template() == {"role": "system", "content": "be brief"}
    tool = ChatMessage(role="tool", content="3", tool_call_id="c1", refusal=None)  # fields of OpenAI's own: ignored
    assert tool.for_template() == {"role": "tool", "content": "3", "tool_call_id": "c1"}
