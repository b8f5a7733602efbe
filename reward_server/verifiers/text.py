"""Format and string rewards: ``exact``, ``numeric`` (with tolerance) and ``regex``."""

from __future__ import annotations

import math
import re

from reward_server.extract import extract
from reward_server.verifiers.result import scored
from services.wire import ExactSpec, NumericSpec, RegexSpec, ScoreResult

REGEX_TEXT_CAP = 200_000  # Python's re has no timeout; cap the haystack a pattern runs over


def exact(item_id: str, completion: str, spec: ExactSpec) -> ScoreResult:
    got = extract(completion, spec.extract)
    if got is None:
        return scored(item_id, 0.0, "no_answer", f"nothing to extract ({spec.extract})")
    want = spec.answer
    if spec.strip:
        got, want = got.strip(), want.strip()
    if not spec.case_sensitive:
        got, want = got.casefold(), want.casefold()
    if got == want:
        return scored(item_id, 1.0, "ok")
    return scored(item_id, 0.0, "wrong_answer", f"got {got[:200]!r}")


def numeric(item_id: str, completion: str, spec: NumericSpec) -> ScoreResult:
    got = extract(completion, spec.extract)
    if got is None:
        return scored(item_id, 0.0, "no_answer", f"nothing to extract ({spec.extract})")
    try:
        value = float(got.replace(",", "").strip())
    except ValueError:
        return scored(item_id, 0.0, "wrong_answer", f"not a number: {got[:200]!r}")
    if not math.isfinite(value):
        return scored(item_id, 0.0, "wrong_answer", f"not finite: {got[:200]!r}")
    error = abs(value - spec.answer)
    bound = spec.tolerance * abs(spec.answer) if spec.relative else spec.tolerance
    if error <= bound:
        return scored(item_id, 1.0, "ok")
    return scored(item_id, 0.0, "wrong_answer", f"got {value}, off by {error:g}")


def regex(item_id: str, completion: str, spec: RegexSpec) -> ScoreResult:
    try:
        pattern = re.compile(spec.pattern, re.DOTALL)
    except re.error as e:
        # The spec's fault, not the completion's: report it, score 0.
        return scored(item_id, 0.0, "wrong_answer", f"invalid pattern: {e}")
    text = completion[:REGEX_TEXT_CAP]
    match = pattern.fullmatch(text) if spec.mode == "fullmatch" else pattern.search(text)
    return scored(item_id, 1.0, "ok") if match else scored(item_id, 0.0, "wrong_answer", "format not matched")
