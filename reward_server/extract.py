"""Pull the answer (or the program) out of a model's completion.

The ``Extract`` modes of :mod:`services.reward_specs`: the last ``<answer>...</answer>``,
the last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` works),
the last number, or the whole text; and for code, the last fenced block
(a ``python``-labelled one preferred) or the whole completion.
Each function returns None when there is nothing to extract.

Completions are untrusted and run on the reward server's event loop, so every
function here takes time linear in the completion's length: tags, braces and
fences are found by plain scanning (a lazy ``<answer>(.*?)</answer>`` or a
per-``\\boxed`` brace walk would be quadratic on ``"<answer>" * 50_000``), and
the one regular expression left (``NUMBER``) cannot backtrack.
"""

from __future__ import annotations

import re

from services.reward_specs import Extract

ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)
ANSWER_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
FENCE = "```"
FENCE_LANGUAGE = re.compile(r"[ \t]*([\w+-]*)")
BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _closing_braces(text: str, first: int) -> dict[int, int]:
    """Index of each ``{`` at or after ``first`` -> index of the ``}`` that balances it (one pass)."""
    closes, stack = {}, []
    for i in range(first, len(text)):
        ch = text[i]
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closes[stack.pop()] = i
    return closes


def boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces."""
    starts = [m.end() for m in BOXED.finditer(text)]
    if not starts:
        return None
    closes = _closing_braces(text, starts[0] - 1)
    for start in reversed(starts):
        end = closes.get(start - 1)
        if end is not None:
            return text[start:end].strip()
    return None


def answer_tag(text: str) -> str | None:
    """The last ``<answer>...</answer>`` (any case): each opening tag pairs with the first closing one after it."""
    found, pos = None, 0
    while (opening := ANSWER_OPEN.search(text, pos)) is not None:
        closing = ANSWER_CLOSE.search(text, opening.end())
        if closing is None:
            break  # no later opening tag can close either
        found, pos = text[opening.end():closing.start()], closing.end()
    return found.strip() if found is not None else None


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract(text: str, mode: Extract) -> str | None:
    """The answer in ``text`` per ``mode``; None (not "") when there is none."""
    if mode == "answer_tag":
        value = answer_tag(text)
    elif mode == "boxed":
        value = boxed(text)
    elif mode == "last_number":
        value = last_number(text)
    else:
        value = text.strip()
    return value if value else None


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block: a ````` ``` ````` line opens one (its info string's
    first word is the language), the next ````` ``` ````` or the end of the text closes it."""
    blocks, pos = [], 0
    while (start := text.find(FENCE, pos)) >= 0:
        newline = text.find("\n", start + len(FENCE))
        if newline < 0:
            break  # an opening fence needs its line ended; none further on can have one either
        language = FENCE_LANGUAGE.match(text, start + len(FENCE), newline).group(1)
        end = text.find(FENCE, newline + 1)
        if end < 0:
            blocks.append((language, text[newline + 1:]))
            break
        blocks.append((language, text[newline + 1:end]))
        pos = end + len(FENCE)
    return blocks


def code(text: str, mode: str = "fenced") -> str | None:
    """The program in a completion: the last ``python`` fenced block, else the last fenced block."""
    if mode == "whole":
        return text if text.strip() else None
    blocks = fenced_blocks(text)
    if not blocks:
        return None
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    body = (python or [body for _lang, body in blocks])[-1]
    return body if body.strip() else None
