"""The prompt-set format: JSON lines, each a prompt and a reward spec, validated line by line.

A line is ``{"prompt": str, <reward-spec fields>}``: the spec fields are
those of one of ``services.reward_specs.RewardSpec``'s types, named by ``"type"``.
Instead of ``prompt`` a line may carry ``messages`` (chat turns,
``services.wire.Messages``: ``[{"role": "system"|"user"|"assistant",
"content": str}, ...]``, the last the user's), or neither: then its fields that
are not the spec's (``{"question": ..., "answer": ...}`` under ``math``:
``question``) are its *inputs*, strings or numbers that a run's
``prompt.template`` fills in. A run turns each form into what the model
reads (``services.prompt_forms``); the stored line keeps ``prompt``, ``messages``
or ``inputs`` beside ``spec`` (typed) or ``fields`` (untyped).
A line without ``"type"`` takes the run config's ``reward.type`` and
``reward.extract`` when a run starts (:func:`line_specs`; at upload it is
checked against ``default_type``). A line may also carry ``episode``
(``services.wire.EpisodeSpec``: tools, ``max_turns``, a token budget): its
samples are then multi-turn episodes (``rollout_server.episodes``). Blank lines are skipped. Errors name the
1-based line and the field.

A line is strict JSON (RFC 8259) of bounded shape, so that what is accepted
can be stored (msgpack) and echoed (JSON) without surprises: objects and
arrays nest at most :data:`MAX_DEPTH` deep; no ``NaN``/``Infinity``, no float
that overflows to infinity, no integer outside the signed 64-bit range, no
lone surrogate escape (``"\\ud800"``, not Unicode); the bytes are UTF-8.
:class:`LineParser` can also cap the number of lines and the length of one.

Both readers of prompt sets use this module: the control plane when a set
is uploaded and a run starts (``control_plane``), and the main job's
held-out evaluation (``services.evaluate``). When ``reward.format_weight >
0`` every spec ``S`` becomes ``combined(1.0 x S, format_weight x
regex(<answer>...</answer>))``.
"""

from __future__ import annotations

import json
import math
from typing import get_args

from pydantic import TypeAdapter, ValidationError

from services.config import RunConfig
from services.reward_specs import (
    REWARD_TYPES,
    TRL_KEYWORDS,
    CombinedSpec,
    RegexSpec,
    RewardSpec,
    WeightedSpec,
)
from services.wire import EpisodeSpec, Messages

MAX_ERRORS = 20
"""An upload stops being parsed after this many bad lines (the 422 lists them)."""

MAX_DEPTH = 32
"""Deepest nesting of objects and arrays in one line (the line's object is depth 1). A spec
combined as deep as ``services.reward_specs.MAX_COMBINED_DEPTH`` allows needs about 15."""

INT_RANGE = (-(1 << 63), 1 << 63)
"""Integers a line may hold: [low, high), what msgpack and the other services' JSON readers take."""

SPEC = TypeAdapter(RewardSpec)
MESSAGES = TypeAdapter(Messages)
SPEC_FIELDS: dict[str, frozenset[str]] = {
    cls.model_fields["type"].default: frozenset(cls.model_fields) for cls in get_args(get_args(RewardSpec)[0])
}
"""The fields of each reward type's spec: the other fields of a line without prompt or messages are its inputs."""


class LineError(ValueError):
    """Bad lines: ``errors`` holds ``{"line", "field", "msg"}`` per problem."""

    def __init__(self, errors: list[dict]) -> None:
        self.errors = errors
        shown = "; ".join(format_error(e) for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__(shown + more)


def format_error(e: dict) -> str:
    where = f"line {e['line']}: " if e.get("line") else ""
    return f"{where}{e['field']}: {e['msg']}" if e.get("field") else f"{where}{e['msg']}"


def spec_errors(err: ValidationError, line: int) -> list[dict]:
    """Pydantic's errors on a reward spec as ``{"line", "field", "msg"}``, the union tag left out."""
    out = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            field = ".".join(loc[1:] + ["type"])
            msg = "field required" if e["type"] == "union_tag_not_found" else (
                f"unknown reward type (expected one of {', '.join(REWARD_TYPES)})"
            )
            out.append({"line": line, "field": field, "msg": msg})
            continue
        field = ".".join(loc[1:]) or "spec"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        out.append({"line": line, "field": field, "msg": msg})
    return out


def check_line(obj: object, line: int, default_type: str) -> tuple[dict, list[dict]]:
    """Validate one decoded line; return (the stored form, errors)."""
    if not isinstance(obj, dict):
        return {}, [{"line": line, "field": "", "msg": "expected a JSON object"}]
    fields = dict(obj)
    typed = "type" in fields
    episode, errors = _episode(fields.pop("episode", None), line)
    form, form_errors = _prompt_form(fields, line, fields.get("type") if typed else default_type)
    errors += form_errors
    form = {**form, **episode}
    try:
        spec = SPEC.validate_python(fields if typed else {**fields, "type": default_type})
    except ValidationError as e:
        return {}, errors + spec_errors(e, line)
    if errors:
        return {}, errors
    if typed:
        return {**form, "spec": spec.model_dump(mode="json")}, []
    return {**form, "fields": fields}, []


def _episode(value: object, line: int) -> tuple[dict, list[dict]]:
    """A line's ``episode`` (``services.wire.EpisodeSpec``) as stored: ``({"episode": {...}} or {}, errors)``."""
    if value is None:
        return {}, []
    try:
        spec = EpisodeSpec.model_validate(value)
    except ValidationError as e:
        return {}, [{"line": line, "field": ".".join(["episode", *(str(p) for p in err["loc"])]),
                     "msg": "unknown field" if err["type"] == "extra_forbidden" else err["msg"]} for err in e.errors()]
    return {"episode": spec.model_dump(mode="json")}, []


def _prompt_form(fields: dict, line: int, kind: object) -> tuple[dict, list[dict]]:
    """Take the prompt form out of ``fields`` (what is left is the spec's): ``({"prompt"|"messages"|"inputs":
    ...}, errors)``. ``kind`` is the line's reward type (its fields are not inputs)."""
    has_prompt, has_messages = "prompt" in fields, "messages" in fields
    prompt, messages = fields.pop("prompt", None), fields.pop("messages", None)
    if has_prompt and has_messages:
        return {}, [{"line": line, "field": "messages", "msg": "give either prompt or messages, not both"}]
    if has_prompt:
        if not isinstance(prompt, str) or not prompt:
            return {}, [{"line": line, "field": "prompt", "msg": "must be a non-empty string"}]
        return {"prompt": prompt}, []
    if has_messages:
        try:
            checked = MESSAGES.validate_python(messages)
        except ValidationError as e:
            return {}, [{"line": line, "field": ".".join(["messages", *(str(p) for p in err["loc"])]),
                         "msg": "unknown field" if err["type"] == "extra_forbidden" else err["msg"]}
                        for err in e.errors()]
        return {"messages": [m.model_dump() for m in checked]}, []
    spec_fields = SPEC_FIELDS.get(kind, frozenset()) if isinstance(kind, str) else frozenset()
    inputs = {k: fields.pop(k) for k in list(fields) if k not in spec_fields and k != "type"}
    if not inputs:
        return {}, [{"line": line, "field": "prompt",
                     "msg": "field required (or messages, or the fields a run's prompt.template fills in)"}]
    errors = [{"line": line, "field": k, "msg": "a field for prompt.template must be a string or a number"}
              for k, v in inputs.items() if not isinstance(v, str | int | float) or isinstance(v, bool)]
    return {"inputs": inputs}, errors


class _NotJSON:
    """What the decoder makes of ``NaN``, ``Infinity`` and over-long integers: refused by :func:`bad_value`."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _constant(name: str) -> _NotJSON:
    return _NotJSON(f"{name} is not valid JSON (use a finite number or a string)")


def _integer(digits: str) -> int | _NotJSON:
    # 20 characters hold every int64 with its sign; a longer literal is never converted (Python
    # refuses past 4300 digits with a ValueError, and converting is quadratic below that)
    if len(digits) <= 20:
        return int(digits)
    return _NotJSON(f"integer out of range (at most {len(str(INT_RANGE[1]))} digits)")


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_int=_integer)


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(key: str) -> str:
    """A key as an error may echo it (a lone surrogate escaped, so the 422 itself encodes)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_value(obj: object, escapes: bool = True) -> tuple[str, str] | None:
    """(dotted field, problem) of the first value a line may not hold, in document order; None if none.

    ``escapes=False`` (the line's text has no ``\\u``) skips the lone-surrogate check: UTF-8
    that decoded strictly cannot hold one.
    """
    stack: list[tuple[tuple[str, ...], object, int]] = [((), obj, 1)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                return ".".join(path), f"nested deeper than {MAX_DEPTH} levels"
            if isinstance(value, dict):
                items = []
                for key, item in value.items():
                    if escapes and not _unicode(key):
                        return ".".join([*path, _shown(key)]), "key holds a lone surrogate escape (not Unicode)"
                    items.append(((*path, key), item, depth + 1))
            else:
                items = [((*path, str(i)), item, depth + 1) for i, item in enumerate(value)]
            stack.extend(reversed(items))
        elif isinstance(value, str):
            if escapes and not _unicode(value):
                return ".".join(path), "lone surrogate escape in a string (not Unicode)"
        elif isinstance(value, _NotJSON):
            return ".".join(path), value.problem
        elif isinstance(value, float):
            if not math.isfinite(value):
                return ".".join(path), "number out of range (overflows to infinity)"
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT_RANGE[0] <= value < INT_RANGE[1]:
                return ".".join(path), "integer out of range (signed 64-bit)"
    return None


def decode_line(text: str) -> tuple[object, dict | None]:
    """The JSON value of one line's text, or an error ``{"field", "msg"}`` (no line number)."""
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        return None, {"field": "", "msg": f"invalid JSON: {e.msg} (column {e.colno})"}
    except RecursionError:
        # the C decoder gives up past the interpreter's recursion limit (~1000 levels), building nothing
        return None, {"field": "", "msg": f"nested deeper than {MAX_DEPTH} levels"}
    bad = bad_value(obj, escapes="\\u" in text)
    if bad is not None:
        return None, {"field": bad[0], "msg": bad[1]}
    return obj, None


class LineParser:
    """Incremental JSON-lines parser: ``feed`` chunks as they arrive, then ``finish``.

    Raises :class:`LineError` as soon as :data:`MAX_ERRORS` lines are bad, or
    a line is longer than ``max_line_bytes``, or there are more than
    ``max_lines`` non-blank lines; otherwise at :meth:`finish` if any were bad.
    Each good line goes to :meth:`keep` (by default appended to ``lines``).
    Memory: the good lines as kept, plus the chunk being fed and one partial line.
    """

    def __init__(
        self, default_type: str = "math", *, max_lines: int | None = None, max_line_bytes: int | None = None
    ) -> None:
        self.default_type = default_type
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes
        self.lines: list[dict] = []
        self.count = 0
        self.types: dict[str, int] = {}
        self.forms: dict[str, int] = {}
        self.errors: list[dict] = []
        self.nbytes = 0
        self._partial: list[bytes] = []
        self._partial_bytes = 0
        self._lineno = 0
        self._nonblank = 0

    def feed(self, chunk: bytes) -> None:
        self.nbytes += len(chunk)
        if b"\n" not in chunk:
            self._partial.append(chunk)  # joined once its line ends: no quadratic copying
            self._partial_bytes += len(chunk)
            self._check_length(self._partial_bytes)
            return
        first, *complete, last = chunk.split(b"\n")
        self._line(b"".join([*self._partial, first]))
        for raw in complete:
            self._line(raw)
        self._partial = [last]
        self._partial_bytes = len(last)
        self._check_length(self._partial_bytes)

    def finish(self) -> list[dict]:
        rest = b"".join(self._partial)
        self._partial = []
        if rest:
            self._line(rest)
        if self.errors:
            raise LineError(self.errors)
        if not self.count:
            raise LineError([{"line": 0, "field": "", "msg": "the prompt set is empty (no JSON lines)"}])
        return self.lines

    def keep(self, stored: dict) -> None:
        """Hold one good line's stored form (a subclass may encode it instead)."""
        self.lines.append(stored)

    def _check_length(self, nbytes: int) -> None:
        if self.max_line_bytes is not None and nbytes > self.max_line_bytes:
            self.errors.append(
                {"line": self._lineno + 1, "field": "", "msg": f"line longer than {self.max_line_bytes} bytes"}
            )
            raise LineError(self.errors)  # the rest of the line is not read

    def _count(self) -> None:
        """One more non-blank line: past ``max_lines`` nothing more is read."""
        self._nonblank += 1
        if self.max_lines is not None and self._nonblank > self.max_lines:
            self.errors.append({"line": self._lineno, "field": "", "msg": f"more than {self.max_lines} lines"})
            raise LineError(self.errors)

    def _line(self, raw: bytes) -> None:
        self._lineno += 1
        self._check_length(len(raw))
        if self._lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            self._count()
            return self._error({"line": self._lineno, "field": "", "msg": f"not valid UTF-8 (byte {e.start})"})
        if not text:
            return None
        self._count()
        obj, error = decode_line(text)
        if error is not None:
            return self._error({"line": self._lineno, **error})
        stored, errors = check_line(obj, self._lineno, self.default_type)
        for e in errors:
            self._error(e)
        if not errors:
            self.keep(stored)
            self.count += 1
            kind = stored["spec"]["type"] if "spec" in stored else "default"
            self.types[kind] = self.types.get(kind, 0) + 1
            form = "prompt" if "prompt" in stored else "messages" if "messages" in stored else "template"
            self.forms[form] = self.forms.get(form, 0) + 1
        return None

    def _error(self, e: dict) -> None:
        self.errors.append(e)
        if len(self.errors) >= MAX_ERRORS:
            raise LineError(self.errors)


ANSWER_TAG = r"<answer>.*?</answer>"
"""The format reward's pattern (the answer tag is present)."""

EXTRACTING = frozenset({"math", "exact", "numeric"})


def line_specs(lines: list[dict], config: RunConfig) -> list:
    """The reward spec of every line under ``config``; raises :class:`LineError` (1-based line numbers)."""
    specs, errors = [], []
    for i, line in enumerate(lines, start=1):
        if "spec" in line:
            raw = line["spec"]
        else:
            raw = {"type": config.reward.type, **line["fields"]}
            if config.reward.type in EXTRACTING and "extract" not in raw:
                raw["extract"] = config.reward.extract
        if raw.get("type") == "python" and line.get("inputs"):
            # a template line's inputs are its fields too: a python reward function gets every field as a
            # keyword, as TRL passes every dataset column (those that can be keywords)
            inputs = {k: v for k, v in line["inputs"].items() if k.isidentifier() and k not in TRL_KEYWORDS}
            raw = {**raw, "kwargs": {**inputs, **raw.get("kwargs", {})}}
        try:
            spec = SPEC.validate_python(raw)
            if config.reward.format_weight > 0:  # one level and one leaf more: the caps apply to the result
                spec = CombinedSpec(
                    parts=[
                        WeightedSpec(weight=1.0, spec=spec),
                        WeightedSpec(weight=config.reward.format_weight, spec=RegexSpec(pattern=ANSWER_TAG)),
                    ]
                )
        except ValidationError as e:
            errors += spec_errors(e, i)
            if len(errors) >= MAX_ERRORS:
                break  # a config that fits no line would otherwise list every line
            continue
        specs.append(spec)
    if errors:
        raise LineError(errors)
    return specs
