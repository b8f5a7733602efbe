"""The chat example's reward: a TRL reward function, as a user brings one.

The reward server imports it from this folder (on its ``PYTHONPATH``) once
``TANDEM_REWARD_FUNCTIONS`` allows it (docs/rewards.md):

    export PYTHONPATH=$PWD/examples/chat_arith
    export TANDEM_REWARD_FUNCTIONS='["arith_reward:reward"]'

and each imported line names it: ``{"messages": [...], "type": "python",
"function": "arith_reward:reward", "solution": "126"}``. The function is
called batched, with the line's ``solution`` as a list, one per completion, as
TRL passes a dataset column; a chat line's completion comes in TRL's
conversational form, ``[{"role": "assistant", "content": text}]``.
"""

from __future__ import annotations

import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def reward(prompts, completions, solution, **kwargs) -> list[float]:
    """1.0 for a completion whose first ``<answer>...</answer>`` holds the solution, else 0.0."""
    return [1.0 if answer(text(c)) == str(s).strip() else 0.0 for c, s in zip(completions, solution, strict=True)]


def text(completion) -> str:
    """The completion's text: a chat completion's last turn, or the text of a plain one."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def answer(completion: str) -> str | None:
    found = ANSWER.search(completion)
    return found.group(1).strip() if found else None
