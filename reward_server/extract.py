"""Pull the answer (or the program) out of a model's completion.

The ``Extract`` modes of :mod:`services.wire`: the last ``<answer>...</answer>``,
the last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` works),
the last number, or the whole text; and for code, the last fenced block
(a ``python``-labelled one preferred) or the whole completion.
Each function returns None when there is nothing to extract.
"""

from __future__ import annotations

import re

from services.wire import Extract

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces."""
    starts = [m.end() for m in BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def answer_tag(text: str) -> str | None:
    found = ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


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


def code(text: str, mode: str = "fenced") -> str | None:
    """The program in a completion: the last ``python`` fenced block, else the last fenced block."""
    if mode == "whole":
        return text if text.strip() else None
    blocks = FENCE.findall(text)
    if not blocks:
        return None
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    body = (python or [body for _lang, body in blocks])[-1]
    return body if body.strip() else None
