"""The tool example's task: three-digit sums, each line an episode that may call the calculator.

    python -m examples.tool_arith.make_data     # rewrites train.jsonl and eval.jsonl

Deterministic (seeded). Each line is a prompt-set line with an ``episode`` (docs/episodes.md): the
prompt ``a+b=``, an ``exact`` match of the text inside the last turn's ``<answer>`` tags, and the
``calculator`` tool for at most two turns of the model. The held-out set shares no (a, b) with the
training set; its lines are evaluated as episodes too (``[eval]`` in ``run.toml``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SEED, EVAL_SEED = 4321, 4322
N_TRAIN, N_EVAL = 4000, 200
EPISODE = {"tools": ["calculator"], "max_turns": 2, "max_tokens": 96, "tool_timeout_s": 5}


def line(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "type": "exact", "answer": str(a + b), "extract": "answer_tag", "episode": EPISODE}


def pairs(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(n)]


def write(path: Path, rows: list[tuple[int, int]]) -> None:
    path.write_text("".join(json.dumps(line(a, b)) + "\n" for a, b in rows))


if __name__ == "__main__":
    train = pairs(N_TRAIN, SEED)
    seen = set(train)
    held_out = [p for p in pairs(2 * N_EVAL, EVAL_SEED) if p not in seen][:N_EVAL]
    write(HERE / "train.jsonl", train)
    write(HERE / "eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out episode lines to {HERE}")
