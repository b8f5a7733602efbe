"""Generate the example task: two-digit addition with the answer in <answer> tags.

    python examples/arith/make_data.py      # rewrites train.jsonl and eval.jsonl

Deterministic (seeded). The held-out set shares no (a, b) pair with the
training set. Each line is a prompt-set line: ``prompt`` plus reward-spec
fields (here an ``exact`` match of the text inside ``<answer>`` tags).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SEED = 1234
N_EVAL = 200


def line(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "type": "exact", "answer": str(a + b), "extract": "answer_tag"}


def build() -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(SEED).shuffle(pairs)
    held_out, train = pairs[:N_EVAL], pairs[N_EVAL:]
    return [line(a, b) for a, b in train], [line(a, b) for a, b in held_out]


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    train, held_out = build()
    write(HERE / "train.jsonl", train)
    write(HERE / "eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out prompts to {HERE}")
