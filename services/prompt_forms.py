"""What the model reads: each prompt-set line made into a prompt text or chat messages under the run's ``[prompt]``.

Who talks to whom: the control plane calls :func:`prompt_forms` when a run is created
(``control_plane.groups`` for the training set, ``services.evaluate.eval_prompts`` for the
held-out one), so every problem is a 422 then, naming the line and field, never a failure in
the middle of a run. The resulting :class:`~services.wire.PromptGroup` /
:class:`~services.wire.EvalPrompt` carries either ``prompt`` (text the rollout server tokenizes
as it is) or ``messages``, which the rollout server renders with the model's own chat template
(``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
**prompt.chat_template_kwargs)``; ``rollout_server.rendering``).

A stored line (``services.prompt_lines``) has one of three prompt forms, and becomes:

- ``prompt``: the text, or ``prompt.template`` filled with it as ``{prompt}``;
- ``inputs`` (a line with neither ``prompt`` nor ``messages``; its fields that are not the reward
  spec's): ``prompt.template`` filled with them. Every placeholder must be a field of the line
  and every such field must be used (else a typo would go unnoticed); reward-spec fields (the
  answer) are never available to a template;
- ``messages``: the chat turns as they are (a template never applies to them).

``prompt.system_prompt`` becomes a first ``system`` turn: of a messages line that has none of
its own (a line's own system turn wins), and of every prompt and template line, which then
turns into messages ``[system, user: <its text>]``, so it needs a chat template.

Whether the model has a chat template (:func:`chat_template_in`) is read from ``model.path``'s
files, as ``transformers`` would load them, without importing it. A model folder with no
tokenizer or model files in it yet is "unknown": messages are accepted then, and a rollout
server whose model has no chat template refuses each such group (dead-lettered, naming
``messages``). A run whose model folder the control plane cannot see at all is refused
(``control_plane.model_path``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.config import RunConfig, template_fields
from services.prompt_lines import LineError
from services.wire import Message

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
"""Where ``transformers`` (>= 4.5x) saves chat templates: the default one in ``chat_template.jinja``, named
ones as ``additional_chat_templates/<name>.jinja``; older versions put them in ``tokenizer_config.json``."""
MODEL_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")


@dataclass(frozen=True)
class PromptForm:
    """What one line gives the model: ``prompt`` text or chat ``messages`` (exactly one)."""

    prompt: str | None = None
    messages: tuple[Message, ...] | None = None

    def wire_fields(self) -> dict:
        """The ``prompt``/``messages`` fields of a :class:`~services.wire.PromptGroup` or ``EvalPrompt``."""
        if self.messages is not None:
            return {"messages": list(self.messages)}
        return {"prompt": self.prompt}


def chat_template_in(model_dir: Path) -> bool | None:
    """Whether the tokenizer in ``model_dir`` has a default chat template; None when that cannot be
    told (no such directory here, or it holds no tokenizer or model files yet).

    Follows ``transformers``' loading: template files, when present, replace ``tokenizer_config.json``'s
    ``chat_template``; a set of named templates counts only with one named ``default`` (what
    ``apply_chat_template`` uses when asked for none)."""
    d = Path(model_dir)
    try:
        if not d.is_dir():
            return None
        names = {"default"} if (d / CHAT_TEMPLATE_FILE).is_file() else set()
        if (d / CHAT_TEMPLATE_DIR).is_dir():
            names |= {p.name.removesuffix(".jinja") for p in (d / CHAT_TEMPLATE_DIR).glob("*.jinja")}
        if names:
            return "default" in names
        config = d / "tokenizer_config.json"
        if not config.is_file():
            return False if any((d / f).is_file() for f in MODEL_FILES) else None
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):
        return any(isinstance(t, dict) and t.get("name") == "default" for t in template)
    return isinstance(template, str)


def _no_chat_template(config: RunConfig) -> str:
    return (f"the model at {config.model.path} has no chat template (no {CHAT_TEMPLATE_FILE}, no chat_template in "
            "its tokenizer_config.json)")


def prompt_forms(lines: list[dict], config: RunConfig, chat: bool | None) -> list[PromptForm]:
    """The prompt form of every stored line under ``config``; ``chat`` says whether the model has a
    chat template (:func:`chat_template_in`; None = unknown). Raises :class:`~services.prompt_lines.LineError`
    naming 1-based lines and fields (a problem of the config itself as line 0)."""
    settings = config.prompt
    system = Message(role="system", content=settings.system_prompt) if settings.system_prompt is not None else None
    used = template_fields(settings.template) if settings.template is not None else None
    forms, errors = [], []
    for number, line in enumerate(lines, start=1):
        if "messages" in line:
            if chat is False:
                errors.append({"line": number, "field": "messages",
                               "msg": f"{_no_chat_template(config)}; give this line a prompt instead"})
                continue
            messages = tuple(Message.model_validate(m) for m in line["messages"])
            if system is not None and messages[0].role != "system":
                messages = (system, *messages)
            forms.append(PromptForm(messages=messages))
            continue
        values = {"prompt": line["prompt"]} if "prompt" in line else line.get("inputs", {})
        # a python reward function gets a template line's fields as keywords (services.prompt_lines.line_specs):
        # a field the template does not use is then the function's, not unknown
        python = line.get("spec", {"type": config.reward.type})["type"] == "python"
        text, problems = _filled(settings.template, used, values, number, others_ok=python)
        errors += problems
        if problems:
            continue
        if system is None:
            forms.append(PromptForm(prompt=text))
        elif chat is False:
            raise LineError(errors + [{"line": 0, "field": "prompt.system_prompt",
                                       "msg": f"{_no_chat_template(config)}, so the system prompt cannot be given "
                                              "to prompt lines; write it into prompt.template instead"}])
        else:
            forms.append(PromptForm(messages=(system, Message(role="user", content=text))))
    if errors:
        raise LineError(errors)
    return forms


def _filled(template: str | None, used: list[str] | None, values: dict, number: int,
            others_ok: bool = False) -> tuple[str, list[dict]]:
    """(the line's text, problems): ``template`` filled from ``values`` (a prompt line's ``{"prompt": text}``
    or a template line's inputs); ``others_ok``: inputs the template does not use are no problem."""
    if template is None:
        if "prompt" in values and len(values) == 1:
            return values["prompt"], []
        fields = ", ".join(sorted(values))
        return "", [{"line": number, "field": "prompt",
                     "msg": f"field required: the line has no prompt or messages, and the run sets no "
                            f"prompt.template to build one from its fields ({fields})"}]
    problems = []
    for name in used:
        if name not in values:
            have = ", ".join(sorted(values))
            problems.append({"line": number, "field": name,
                             "msg": f"prompt.template uses {{{name}}}, and the line has no such field (it has: {have})"})
    for name in values:
        if name not in used and (name == "prompt" or not others_ok):
            problems.append({"line": number, "field": name, "msg": (
                "prompt.template does not use {prompt}, so this line's prompt would be lost" if name == "prompt"
                else "unknown field (not a field of the reward spec, and prompt.template does not use it)")})
    if problems:
        return "", problems
    text = template.format_map({name: _text(values[name]) for name in used})
    if not text:
        return "", [{"line": number, "field": "prompt", "msg": "prompt.template filled in gives an empty prompt"}]
    return text, []


def _text(value: object) -> str:
    return value if isinstance(value, str) else str(value)  # a number, as the line wrote it
