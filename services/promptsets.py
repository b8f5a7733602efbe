"""The prompt-set format: JSON lines, each a prompt and a reward spec, validated line by line.

A line is ``{"prompt": str, <reward-spec fields>}``: the spec fields are
those of one of ``services.wire.RewardSpec``'s types, named by ``"type"``.
A line without ``"type"`` takes the run config's ``reward.type`` and
``reward.extract`` when a run starts (:func:`line_specs`; at upload it is
checked against ``default_type``). Blank lines are skipped. Errors name the
1-based line and the field.

Both readers of prompt sets use this module: the control plane when a set
is uploaded and a run starts (``services.control``), and the main job's
held-out evaluation (``services.evaluate``). When ``reward.format_weight >
0`` every spec ``S`` becomes ``combined(1.0 x S, format_weight x
regex(<answer>...</answer>))``.
"""

from __future__ import annotations

import json

from pydantic import TypeAdapter, ValidationError

from services.config import RunConfig
from services.wire import REWARD_TYPES, CombinedSpec, RegexSpec, RewardSpec, WeightedSpec

MAX_ERRORS = 20
"""An upload stops being parsed after this many bad lines (the 422 lists them)."""

SPEC = TypeAdapter(RewardSpec)


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
    prompt = fields.pop("prompt", None)
    errors = []
    if prompt is None:
        errors.append({"line": line, "field": "prompt", "msg": "field required"})
    elif not isinstance(prompt, str) or not prompt:
        errors.append({"line": line, "field": "prompt", "msg": "must be a non-empty string"})
    typed = "type" in fields
    try:
        spec = SPEC.validate_python(fields if typed else {**fields, "type": default_type})
    except ValidationError as e:
        return {}, errors + spec_errors(e, line)
    if errors:
        return {}, errors
    if typed:
        return {"prompt": prompt, "spec": spec.model_dump(mode="json")}, []
    return {"prompt": prompt, "fields": fields}, []


class LineParser:
    """Incremental JSON-lines parser: ``feed`` chunks as they arrive, then ``finish``.

    Raises :class:`LineError` as soon as :data:`MAX_ERRORS` lines are bad,
    otherwise at :meth:`finish` if any were.
    """

    def __init__(self, default_type: str = "math") -> None:
        self.default_type = default_type
        self.lines: list[dict] = []
        self.types: dict[str, int] = {}
        self.errors: list[dict] = []
        self.nbytes = 0
        self._partial: list[bytes] = []
        self._lineno = 0

    def feed(self, chunk: bytes) -> None:
        self.nbytes += len(chunk)
        if b"\n" not in chunk:
            self._partial.append(chunk)  # joined once its line ends: no quadratic copying
            return
        first, *complete, last = chunk.split(b"\n")
        self._line(b"".join([*self._partial, first]))
        for raw in complete:
            self._line(raw)
        self._partial = [last]

    def finish(self) -> list[dict]:
        rest = b"".join(self._partial)
        self._partial = []
        if rest:
            self._line(rest)
        if self.errors:
            raise LineError(self.errors)
        if not self.lines:
            raise LineError([{"line": 0, "field": "", "msg": "the prompt set is empty (no JSON lines)"}])
        return self.lines

    def _line(self, raw: bytes) -> None:
        self._lineno += 1
        if self._lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            return self._error({"line": self._lineno, "field": "", "msg": f"not valid UTF-8 (byte {e.start})"})
        if not text:
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return self._error({"line": self._lineno, "field": "", "msg": f"invalid JSON: {e.msg} (column {e.colno})"})
        stored, errors = check_line(obj, self._lineno, self.default_type)
        for e in errors:
            self._error(e)
        if not errors:
            self.lines.append(stored)
            kind = stored["spec"]["type"] if "spec" in stored else "default"
            self.types[kind] = self.types.get(kind, 0) + 1
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
        try:
            spec = SPEC.validate_python(raw)
        except ValidationError as e:
            errors += spec_errors(e, i)
            continue
        if config.reward.format_weight > 0:
            spec = CombinedSpec(
                parts=[
                    WeightedSpec(weight=1.0, spec=spec),
                    WeightedSpec(weight=config.reward.format_weight, spec=RegexSpec(pattern=ANSWER_TAG)),
                ]
            )
        specs.append(spec)
    if errors:
        raise LineError(errors)
    return specs
