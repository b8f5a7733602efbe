"""How a prompt becomes the token ids the engine generates from: the model's tokenizer and chat template.

A completion prompt is encoded as vLLM's completion endpoint encodes it; chat ``messages`` are
rendered by the model's own chat template with the run's ``prompt.chat_template_kwargs``
(:func:`render_chat`, which ``openai_api`` also calls for ``/v1/chat/completions``); an episode's
observation (a tool's output) is encoded literally, so special-token text in it stays text
(``tokenize(special=False)``; docs/security.md). :class:`PromptRendering` is the part of
``engine.RolloutEngine`` that holds the tokenizer vLLM loaded; a template that refuses the
messages is an :class:`~rollout_server.errors.InvalidRequest` naming ``messages``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from rollout_server.errors import InvalidRequest
from services.wire import Message


def render_chat(tokenizer: Any, messages: list[Message] | list[dict], chat_template_kwargs: dict,
                model_dir: Path | str = "the model") -> tuple[str, list[int]]:
    """(text, token ids) of chat ``messages`` as ``tokenizer``'s own chat template renders them, the
    assistant's turn opened (``add_generation_prompt``), ``chat_template_kwargs`` passed to the template.

    The template writes whatever special tokens it wants (a BOS, say), so encoding adds none: what
    vLLM's chat endpoint does too. Raises :class:`InvalidRequest` naming ``messages`` when the
    tokenizer has no chat template or the template refuses the messages (its ``raise_exception``)."""
    import jinja2

    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("messages", f"the tokenizer of {model_dir} has no chat template; send a prompt instead")
    try:
        text = tokenizer.apply_chat_template([m if isinstance(m, dict) else m.model_dump() for m in messages],
                                             tokenize=False,
                                             add_generation_prompt=True, **chat_template_kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise InvalidRequest("messages", f"the chat template refused these messages: {e}") from e
    return text, list(tokenizer.encode(text, add_special_tokens=False))


class PromptRendering:
    """The engine's tokenizer and what it encodes. Uses the engine's ``llm`` and ``model_dir``;
    the tokenizer is read from vLLM once the engine is up (``RolloutEngine.start``)."""

    _tokenizer: Any = None
    llm: Any
    model_dir: Path

    async def _load_tokenizer(self) -> None:
        tok = self.llm.get_tokenizer()
        self._tokenizer = await tok if inspect.isawaitable(tok) else tok  # async in older vLLM

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, as vLLM loaded it (the chat template's and the decoder's)."""
        return self._tokenizer

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``. ``special=True`` is what vLLM does for a completion prompt: BOS (or the
        like) added, and the text of a special token ("<|im_end|>") read as that token. ``special=False``
        encodes untrusted text appended to tokens already there (an episode's observation) literally: none
        added, and a special token's text split into ordinary tokens (``split_special_tokens``), so a tool's
        output cannot end the model's turn or open a forged one. Added tokens that are not special (Qwen3's
        ``<think>``) keep their one id: the model reads the same text either way."""
        if special:
            return list(self._tokenizer.encode(text, add_special_tokens=True))
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def render(self, messages: list[Message], chat_template_kwargs: dict) -> tuple[str, list[int]]:
        """(text, token ids) of chat ``messages`` with the model's chat template (:func:`render_chat`)."""
        return render_chat(self._tokenizer, messages, chat_template_kwargs, self.model_dir)

    def prompt_ids(self, prompt: str | None, messages: list[Message] | None,
                   chat_template_kwargs: dict) -> tuple[str, list[int]]:
        """(text, token ids) of a prompt text (:meth:`tokenize`) or of chat messages (:meth:`render`)."""
        if messages is not None:
            return self.render(messages, chat_template_kwargs)
        return prompt, self.tokenize(prompt)
