"""The judged example's prompt sets: the arith example's sums, each line scored by the ``even`` reward model.

    python -m examples.judge_arith.make_data     # rewrites train.jsonl and eval.jsonl from examples/arith's

Each line is ``{"prompt": "a+b=", "type": "reward_model", "model": "even"}``: the judge's name on the reward
server (``TANDEM_REWARD_MODELS``), never a path. The held-out set is arith's, so it shares no (a, b) with
the training set.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
ARITH = HERE.parent / "arith"


def judged(source: Path, target: Path) -> int:
    rows = [json.loads(x) for x in source.read_text().splitlines() if x.strip()]
    target.write_text("".join(json.dumps({"prompt": r["prompt"], "type": "reward_model", "model": "even"}) + "\n"
                              for r in rows))
    return len(rows)


if __name__ == "__main__":
    n = judged(ARITH / "train.jsonl", HERE / "train.jsonl")
    m = judged(ARITH / "eval.jsonl", HERE / "eval.jsonl")
    print(f"wrote {n} training and {m} held-out prompts to {HERE}")
