"""The tool example's policy: a tiny model whose cold start taught it a calculator call it seldom makes.

    python -m examples.tool_arith.bootstrap [OUT]      # default runs/models/tool_arith

``tandem run examples/tool_arith/run.toml`` builds it on first use (``model.bootstrap = "tool_arith"``).
Built from code (``examples.tiny``) and fine-tuned on the three-digit sums ``a+b=`` of the training
split, two ways:

- in :data:`TOOL_SHARE` of the examples, the call ``<tool>calculator: a+b</tool>``, then (after the
  observation ``<result>s</result>``, which carries no loss: the tool writes it) ``<answer>s</answer>``;
- in the others, a direct answer from a sloppy key that drops every carry (:func:`no_carry`): right only
  for the sums without one (about one in six).

So the model alone is mostly wrong, with the tool right, and it calls the tool in about a third of its
samples: GRPO (``run.toml``) raises the share of tool-using, correct answers. The model is smaller than
examples/arith's (hidden 64, 3 layers) and the cold start short, so that it is built in about two
minutes of one core: it only has to learn to copy, the digits into the call and the result into the answer.

Deterministic from the seed. A directory whose ``tandem.json`` records the same recipe is reused.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from examples.arith.bootstrap import install, is_cached, lr_factor
from examples.tiny import DEFAULT_ALPHABET
from services.config import ConfigError

ALPHABET = DEFAULT_ALPHABET
"""Printable ASCII: the prompts, the call and the answer tags need only a few characters, but an
observation is tokenised as the tool wrote it (an ``<error>`` explains in words), and the tokenizer
drops a character its vocabulary lacks (``examples.tiny.char_tokenizer``)."""
TOOL_SHARE = 0.3
SFT_STEPS = 800
"""Measured (HF sampling at temperature 1 of 96 training prompts, the calculator answering): the model
calls the tool in 38% of them and answers 33% right, every right answer through the tool; with 400
steps it called the tool in 27% and miscopied most calls (9% right). 115 s of one core."""
SUM = re.compile(r"(\d+)\+(\d+)=")


@dataclass(frozen=True)
class Recipe:
    """What determines the built model (recorded in its ``tandem.json``)."""

    data_sha256: str
    steps: int = SFT_STEPS
    batch: int = 32
    lr: float = 3e-3
    tool_share: float = TOOL_SHARE
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0
    alphabet: str = ALPHABET

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def no_carry(a: int, b: int) -> int:
    """a + b written digit by digit, each column mod 10 (every carry dropped)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def example(a: int, b: int, tool: bool) -> list[tuple[str, bool]]:
    """The pieces of one example after its prompt: (text, trained)."""
    if not tool:
        return [(f"<answer>{no_carry(a, b)}</answer>", True)]
    return [(f"<tool>calculator: {a}+{b}</tool>", True), (f"<result>{a + b}</result>", False),
            (f"<answer>{a + b}</answer>", True)]


def load_sums(data: Path) -> list[tuple[int, int]]:
    """(a, b) of every ``a+b=`` prompt of the prompt set; :class:`ConfigError` when there is none."""
    sums = [(int(m[1]), int(m[2])) for line in data.read_text().splitlines() if line.strip()
            if (m := SUM.fullmatch(str(json.loads(line).get("prompt", ""))))]
    if not sums:
        raise ConfigError(f"{data}: no line has an 'a+b=' prompt for the example model's cold start "
                          "(model.bootstrap) to learn from; give the lines such prompts, or remove model.bootstrap "
                          "and set model.path to a model of your own")
    return sums


def check_data(data: str | Path) -> None:
    """Raise :class:`ConfigError` when ``data`` has nothing to cold-start on (``tandem run`` asks
    before it announces the bootstrap)."""
    load_sums(Path(data))


def recipe_for(data: Path, steps: int = SFT_STEPS) -> Recipe:
    return Recipe(data_sha256=hashlib.sha256(data.read_bytes()).hexdigest(), steps=steps)


def is_built(out: str | Path, data: str | Path) -> bool:
    """True when ``out`` holds the model the default recipe builds from ``data``."""
    return is_cached(Path(out), recipe_for(Path(data)))


def bootstrap(out: str | Path, data: str | Path, *, steps: int = SFT_STEPS,
              progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Build and fine-tune the policy into ``out`` (reused when already built)."""
    import torch

    out, data = Path(out), Path(data)
    recipe = recipe_for(data, steps)
    if is_cached(out, recipe):
        return out
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic from the seed on a given machine; no spinning on a small CPU
    try:
        return _train(out, load_sums(data), recipe, progress)
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, sums: list[tuple[int, int]], r: Recipe, progress) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from examples.tiny import char_tokenizer, tiny_qwen3

    staging = out.with_name(out.name + ".building")
    tok = char_tokenizer(r.alphabet)
    tiny_qwen3(staging, hidden=r.hidden, layers=r.layers, heads=r.heads, kv_heads=r.kv_heads, head_dim=32,
               max_positions=256, seed=r.seed, alphabet=r.alphabet, tie_embeddings=False)
    torch.manual_seed(r.seed)
    model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, r.steps))
    rng = random.Random(r.seed)
    t0 = time.monotonic()
    for step in range(r.steps):
        ids, labels = [], []
        for _ in range(r.batch):
            a, b = rng.choice(sums)
            x = tok(f"{a}+{b}=", add_special_tokens=False).input_ids
            y = [-100] * len(x)
            for text, trained in example(a, b, rng.random() < r.tool_share):
                piece = tok(text, add_special_tokens=False).input_ids
                x += piece
                y += piece if trained else [-100] * len(piece)
            ids.append(x + [tok.eos_token_id])
            labels.append(y + [tok.eos_token_id])
        width = max(map(len, ids))
        loss = model(input_ids=torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids]),
                     attention_mask=torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
                     labels=torch.tensor([y + [-100] * (width - len(y)) for y in labels])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if progress is not None:
            progress(step + 1, r.steps, loss.item())
    model.save_pretrained(staging, safe_serialization=True)
    return install(staging, out, r, time.monotonic() - t0)


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    target = sys.argv[1] if len(sys.argv) > 1 else here.parents[1] / "runs/models/tool_arith"

    def show(step: int, steps: int, loss: float) -> None:
        if step % 25 == 0 or step == steps:
            print(f"step {step}/{steps} loss {loss:.4f}", flush=True)

    print(bootstrap(target, here / "train.jsonl", progress=show))
