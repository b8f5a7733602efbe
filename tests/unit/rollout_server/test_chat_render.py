"""The rollout engine's chat rendering (``rollout_server.rendering.render_chat``) on real tokenizers, without
starting vLLM: what the template writes is what is generated from (no special tokens added on top), and
a tokenizer without a chat template or a template that refuses the messages is an InvalidRequest naming
``messages`` (the actor dead-letters such a group). The same rendering on the session's vLLM engine:
tests/integration/rollout_server/test_chat_prompts.py."""

from __future__ import annotations

import pytest

from services.wire import Message

CHAT = [Message(role="user", content="2+2?")]


def bos_adding(chat_template: str | None):
    """The tiny char tokenizer, made to put ``<bos>`` before plain text (as Llama's does)."""
    from tokenizers import processors

    from examples.tiny import char_tokenizer

    tok = char_tokenizer(chat_template=chat_template)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    return tok


def test_the_template_writes_the_special_tokens_and_encoding_adds_none():
    from examples.tiny import CHAT_TEMPLATE
    from rollout_server.rendering import render_chat

    tok = bos_adding(CHAT_TEMPLATE)
    assert tok.encode("ab")[0] == tok.bos_token_id  # plain text gets the tokenizer's BOS
    text, ids = render_chat(tok, CHAT, {"enable_thinking": False})
    assert text == "<bos><|user|>2+2?\n<|assistant|><think></think>"
    assert ids == [tok.bos_token_id] + tok.convert_tokens_to_ids(list(text[len("<bos>"):]))  # one BOS: the template's


def test_no_chat_template_or_a_refusing_one_is_invalid_naming_messages():
    from examples.tiny import char_tokenizer
    from rollout_server.errors import InvalidRequest
    from rollout_server.rendering import render_chat

    with pytest.raises(InvalidRequest) as e:
        render_chat(char_tokenizer(), CHAT, {}, "/models/base")
    assert e.value.field == "messages" and "/models/base has no chat template" in e.value.message
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('a system turn must come first') }}{% endif %}"
    with pytest.raises(InvalidRequest) as e:
        render_chat(char_tokenizer(chat_template=strict), CHAT, {})
    assert e.value.field == "messages" and "a system turn must come first" in e.value.message
