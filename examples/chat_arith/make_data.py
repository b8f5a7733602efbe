"""Write the chat example's dataset as Parquet: two-digit addition asked in a chat turn.

    python examples/chat_arith/make_data.py runs/chat_arith    # writes train.parquet and eval.parquet there

The problems are examples/arith's, split the same way (``examples.arith.make_data.build``: 7900
for training, 200 held out, no (a, b) pair in both), so the held-out problems are new to the arith
model the chat policy starts from too. Each row is what a chat dataset on the Hugging Face hub
looks like, not a prompt-set line: a ``conversation`` column of ``{role, content}`` turns, the
``solution``, and a ``carry`` column that the import leaves out (only mapped columns are sent).
"""

from __future__ import annotations

import sys
from pathlib import Path

from examples.arith.bootstrap import has_carry
from examples.arith.make_data import build


def rows(lines: list[dict]) -> dict[str, list]:
    """Column -> values, one row per arith prompt-set line."""
    conversation, solution, carry = [], [], []
    for line in lines:
        conversation.append([{"role": "user", "content": line["prompt"]}])
        solution.append(line["answer"])
        carry.append(has_carry(line["prompt"]))
    return {"conversation": conversation, "solution": solution, "carry": carry}


def write(out: Path) -> tuple[Path, Path]:
    """``out``/train.parquet and ``out``/eval.parquet (deterministic: the same bytes every time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    train, held_out = build()
    paths = out / "train.parquet", out / "eval.parquet"
    for path, lines in zip(paths, (train, held_out), strict=True):
        pq.write_table(pa.table(rows(lines)), path)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/chat_arith/make_data.py OUT_DIR")
    train, held_out = write(Path(sys.argv[1]))
    print(f"wrote {train} and {held_out}")
