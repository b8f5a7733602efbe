"""The chat example's policy: the arith model, given a chat template and cold-started on chat prompts.

    python -m examples.chat_arith.bootstrap --config examples/chat_arith/run.toml

builds ``model.path`` of the config from ``data.train`` (the Parquet file ``make_data.py`` wrote):

1. the arith example's model (``examples.arith.bootstrap``, ``runs/models/arith`` unless ``--base``
   says otherwise; built there first if missing, reused as it is otherwise);
2. its character tokenizer grown by the characters of the chat template (new ids after the old ones,
   so every learned embedding keeps its meaning) and given :data:`CHAT_TEMPLATE`, the model's
   embeddings and head grown to match;
3. a short supervised cold start on the training conversations as the rollout server renders them
   (``apply_chat_template`` with the generation prompt, no special tokens added), with the arith
   cold start's training loop (``examples.arith.bootstrap.fine_tune``) and its sloppy answer key
   (``slip``: in 70% of the problems with a carry the answer taught is ten short).

The arith model already computes sums and already carries that slip; the cold start only teaches it
to read the chat form, so it is short, and the policy lands on the arith model's plateau, which GRPO
then climbs off (the figures, and those of the alternatives tried: docs/tutorial.md). Deterministic
from the seed; cached like the arith model (``tandem.json`` records the recipe).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from examples.arith import bootstrap as arith

ARITH_MODEL = Path("runs/models/arith")
ARITH_DATA = Path(__file__).resolve().parents[1] / "arith" / "train.jsonl"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""A chat template with one-letter role tags: ``u:65+61=\na:`` (a system turn is ``s:...\n``, an earlier
answer ``a:...\n``). Short on purpose: the model's attention (rotary positions) reads the operands
at the distances the arith cold start taught, and a long generation prompt between the question
and the answer moves them: with ``examples.tiny.CHAT_TEMPLATE`` (``<bos><|user|>65+61=\n<|assistant|>``,
14 tokens between ``=`` and the answer instead of 3) a cold start of this length left the policy
far below the arith model (docs/tutorial.md)."""
ROLE_CHARS = "".join(sorted(set("s:u:a:\n") - set(arith.ALPHABET)))
"""The characters :data:`CHAT_TEMPLATE` writes that the arith tokenizer lacks."""
CHAT_STEPS = 100
"""Supervised steps of the chat cold start."""


@dataclass(frozen=True)
class ChatRecipe:
    """Everything that determines the chat policy."""

    base_recipe: str
    """The arith model's recipe key."""
    data_sha256: str
    steps: int = CHAT_STEPS
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    chat_template: str = CHAT_TEMPLATE
    role_chars: str = ROLE_CHARS

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def conversations(path: str | Path) -> list[tuple[list[dict], str]]:
    """(conversation, solution) of every row of a Parquet file ``make_data.py`` wrote."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["conversation", "solution"])
    return [(row["conversation"], str(row["solution"])) for row in table.to_pylist()]


def chat_tokenizer():
    """The arith tokenizer grown by :data:`ROLE_CHARS`, with :data:`CHAT_TEMPLATE`."""
    from examples.tiny import char_tokenizer

    return char_tokenizer(arith.ALPHABET, CHAT_TEMPLATE, extra=ROLE_CHARS)


def render(tok, conversation: list[dict]) -> str:
    """The text the rollout server generates from (``rollout_server.rendering.render_chat``)."""
    return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def bootstrap(
    out: str | Path,
    data: str | Path,
    *,
    base: str | Path = ARITH_MODEL,
    steps: int = CHAT_STEPS,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Build the chat policy into ``out`` from the arith model at ``base`` (built there if missing)
    and the training conversations in ``data``; reused when already built."""
    import torch

    out, data, base = Path(out), Path(data), Path(base)
    arith_recipe = arith.recipe_for(ARITH_DATA, seed=seed)
    recipe = ChatRecipe(base_recipe=arith_recipe.key(), data_sha256=hashlib.sha256(data.read_bytes()).hexdigest(),
                        steps=steps, seed=seed)
    if arith.is_cached(out, recipe):
        return out
    arith.bootstrap(base, ARITH_DATA, seed=seed)  # reused as it is when built
    rows = conversations(data)
    # the arith cold start's answer key (the same problems, in the same order, get the same slips)
    keyed = arith.slip([(conv[-1]["content"], solution) for conv, solution in rows], arith.CARRY_SLIP, seed)
    tok = chat_tokenizer()
    pairs = [(render(tok, conv), answer) for (conv, _), (_, answer) in zip(rows, keyed, strict=True)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the arith cold start: deterministic, and no OpenMP spinning
    try:
        return _train(out, base, tok, pairs, recipe, progress)
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, base: Path, tok, pairs: list[tuple[str, str]], recipe: ChatRecipe, progress) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the new characters' rows are drawn around the old rows' mean (transformers' mean_resizing); old ids keep theirs
    model.resize_token_embeddings(len(tok))
    start = time.monotonic()
    arith.fine_tune(model, tok, pairs, steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr,
                    seed=recipe.seed, progress=progress)
    staging = out.with_name(out.name + ".building")
    model.save_pretrained(staging, safe_serialization=True)
    tok.save_pretrained(staging)
    base_meta = json.loads((base / "tandem.json").read_text())
    (staging / "tandem.json").write_text(json.dumps({"kind": "chat_arith", "base": base_meta.get("recipe_key")}))
    return arith.install(staging, out, recipe, time.monotonic() - start)


def greedy_accuracy(model_dir: str | Path, data: str | Path, limit: int | None = None) -> float:
    """Exact-match accuracy of greedy decoding with Hugging Face transformers on the conversations
    of ``data``, each rendered with the model's own chat template (a check, not the eval path)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = conversations(data)[:limit]
    batch = tok([render(tok, conversation) for conversation, _ in rows], add_special_tokens=False, padding=True,
                return_tensors="pt")
    with torch.no_grad():
        done = model.generate(**batch, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(done[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    return sum(text.strip() == arith.completion_text(solution) for text, (_, solution) in zip(texts, rows, strict=True)) / len(rows)


def main(argv: list[str] | None = None) -> None:
    from services.config import load_run_config

    parser = argparse.ArgumentParser(prog="python -m examples.chat_arith.bootstrap", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).parent / "run.toml",
                        help="run config: the model is built at model.path from data.train")
    parser.add_argument("--base", type=Path, default=ARITH_MODEL, help="the arith model (built there if missing)")
    parser.add_argument("--steps", type=int, default=CHAT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = load_run_config(args.config)
    from transformers.utils import logging

    logging.set_verbosity_error()  # the resize's notice of how new rows start, said in this module's docstring
    logging.disable_progress_bar()
    if not arith.is_built(args.base, ARITH_DATA):
        print(f"building the arith model first, into {args.base} (as `tandem bootstrap-model` does)", flush=True)

    def report(step: int, steps: int, loss: float) -> None:
        if step % 25 == 0 or step == steps:
            print(f"chat cold start: step {step}/{steps}, loss {loss:.3f}", flush=True)

    t0 = time.monotonic()
    path = bootstrap(config.model.path, config.data.train, base=args.base, steps=args.steps, seed=args.seed,
                     progress=report)
    print(f"chat policy in {path} ({time.monotonic() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
