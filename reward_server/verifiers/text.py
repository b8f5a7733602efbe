"""Format and string rewards: ``exact``, ``numeric`` (with tolerance) and ``regex``; and the
time-bounded matching of every prompt-set pattern.

Prompt-set patterns (a regex spec's ``pattern``, a judge spec's ``score_pattern``) are written by
untrusted authors and meet untrusted text (completions, judge replies), and a pattern such as
``(a|aa)+$`` backtracks for ever on ``"a" * 60 + "b"``. They are matched with the ``regex``
package (``re``'s syntax) under its ``timeout=``, in a small thread pool of their own: ``regex``
releases the GIL while it matches a ``str``, so the event loop keeps serving, the default
executor is never filled by them, and a pattern that runs out of time ends as ``timeout``
(reward 0) within ``timeout_s``. Compiling cannot be timed; ``services.reward_specs`` bounds it (the
pattern's length and how far its counted repeats expand) before a spec gets here.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import regex as regex_engine

from reward_server.extract import extract
from reward_server.verifiers.result import scored
from services.reward_specs import ExactSpec, NumericSpec, RegexSpec
from services.wire import ScoreResult

REGEX_TEXT_CAP = 200_000  # characters of a completion a regex spec's pattern runs over
REGEX_TIMEOUT_S = 1.0
"""Default bound of one pattern match (the reward server's ``regex_timeout_s``)."""
_POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="tandem-regex")

PatternError = regex_engine.error
"""Raised by :func:`match` / :func:`last_match` for a pattern ``regex`` cannot compile."""


def _match(pattern: str, text: str, mode: Literal["search", "fullmatch"], flags: int,
           timeout_s: float) -> regex_engine.Match | None:
    compiled = regex_engine.compile(pattern, flags)  # regex keeps a cache of compiled patterns
    if mode == "fullmatch":
        return compiled.fullmatch(text, timeout=timeout_s)
    return compiled.search(text, timeout=timeout_s)


def _last(pattern: str, text: str, timeout_s: float) -> regex_engine.Match | None:
    # finditer's timeout restarts at every match, so the remaining time is handed to each search.
    compiled = regex_engine.compile(pattern)
    deadline = time.monotonic() + timeout_s
    last, pos = None, 0
    while pos <= len(text):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("regex timed out")
        found = compiled.search(text, pos, timeout=remaining)
        if found is None:
            break
        last = found
        pos = found.end() if found.end() > found.start() else found.end() + 1
    return last


async def match(pattern: str, text: str, mode: Literal["search", "fullmatch"] = "search", *,
                flags: int = 0, timeout_s: float = REGEX_TIMEOUT_S) -> regex_engine.Match | None:
    """``pattern`` searched (or full-matched) in ``text`` off the event loop.

    Raises ``TimeoutError`` past ``timeout_s`` and :data:`PatternError` for a bad pattern."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, _match, pattern, text, mode, flags, timeout_s)


async def last_match(pattern: str, text: str, *, timeout_s: float = REGEX_TIMEOUT_S) -> regex_engine.Match | None:
    """The last of the non-overlapping matches of ``pattern`` in ``text``, all found within ``timeout_s``."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, _last, pattern, text, timeout_s)


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


async def regex(item_id: str, completion: str, spec: RegexSpec, timeout_s: float = REGEX_TIMEOUT_S) -> ScoreResult:
    try:
        found = await match(spec.pattern, completion[:REGEX_TEXT_CAP], spec.mode, flags=regex_engine.DOTALL,
                            timeout_s=timeout_s)
    except PatternError as e:
        # The spec's fault, not the completion's: report it, score 0.
        return scored(item_id, 0.0, "wrong_answer", f"invalid pattern: {e}")
    except TimeoutError:
        return scored(item_id, 0.0, "timeout", f"the pattern did not finish within {timeout_s:g} s "
                                               "(catastrophic backtracking?)")
    return scored(item_id, 1.0, "ok") if found else scored(item_id, 0.0, "wrong_answer", "format not matched")
