"""The example's judge: a tiny reward model, built and trained here in seconds, that prefers even answers.

    python -m examples.judge_arith.judge runs/models/even_judge    # what the example's cold start does too

A Hugging Face sequence classifier with one label (``Qwen3ForSequenceClassification``, the arith policy's
character tokenizer), which tandem's ``reward_model`` spec scores with as TRL scores with a model among
its ``reward_funcs`` (``reward_server.verifiers.reward_models``): the prompt and the completion joined,
no special tokens, ``logits[:, 0]``. It learns, by regression to 1 and 0, to score a completion
``<answer>N</answer>`` about 1 when N is even and about 0 when it is odd or the completion is not
well formed (the tags missing or left open, something after them, no number). A property chosen because a
model this small learns it in seconds and the example policy, which answers the sum or ten short of it,
has it about half the time: GRPO with the judge as its reward raises the share of even answers, which is
what the run's held-out reward (the judge's mean score of greedy held-out answers) shows.

Deterministic from the seed; cached like the policy: a folder whose ``tandem.json`` holds the same
recipe is reused.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from examples.arith.bootstrap import ALPHABET, install, is_cached


@dataclass(frozen=True)
class JudgeRecipe:
    """Everything that determines the judge."""

    steps: int = 150
    """Adam steps; the loss is below 1e-3 after about 100 (3 s on one core)."""
    batch_size: int = 64
    lr: float = 3e-3
    hidden: int = 64
    layers: int = 2
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self) | {"kind": "even_judge"}, sort_keys=True).encode()).hexdigest()[:16]


def example(rng: random.Random) -> tuple[str, float]:
    """One (prompt + completion, target score) the judge learns from: most completions well formed with a
    random N from 0 to 198 (target 1 when N is even), the rest malformed (target 0)."""
    a, b, n = rng.randrange(10, 100), rng.randrange(10, 100), rng.randrange(0, 199)
    prompt = f"{a}+{b}="
    if rng.random() < 0.8:
        return f"{prompt}<answer>{n}</answer>", float(n % 2 == 0)
    malformed = rng.choice([f"<answer>{n}", f"{n}", "<answer></answer>", f"<answer>{n}</answer>{rng.randrange(10)}",
                            "", f"<answer>{n}+</answer>", f"<answer>{n}</answer><answer>"])
    return prompt + malformed, 0.0


def build(out: str | Path, recipe: JudgeRecipe = JudgeRecipe()) -> Path:
    """Build and train the judge into ``out`` (reused when ``out`` holds this recipe's)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from examples.tiny import char_tokenizer

    out = Path(out)
    if is_cached(out, recipe):
        return out
    tok = char_tokenizer(ALPHABET)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=recipe.hidden, intermediate_size=3 * recipe.hidden,
                         num_hidden_layers=recipe.layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=recipe.hidden // 2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic on a given machine, and no spinning against other processes
    try:
        torch.manual_seed(recipe.seed)
        model = Qwen3ForSequenceClassification(config)
        rng = random.Random(recipe.seed)
        opt = torch.optim.Adam(model.parameters(), lr=recipe.lr)
        start = time.monotonic()
        for _ in range(recipe.steps):
            texts, targets = zip(*(example(rng) for _ in range(recipe.batch_size)), strict=True)
            # the reward server's tokenization (reward_models.rewards): no special tokens, padded on the right
            inputs = tok(list(texts), return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
            loss = torch.nn.functional.mse_loss(model(**inputs).logits[:, 0], torch.tensor(targets))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    staging = out.with_name(out.name + ".building")
    model.save_pretrained(staging, safe_serialization=True)
    tok.save_pretrained(staging)
    return install(staging, out, recipe, time.monotonic() - start)


if __name__ == "__main__":
    import sys

    path = build(sys.argv[1] if len(sys.argv) > 1 else "runs/models/even_judge")
    print(f"the judge is in {path}: TANDEM_REWARD_MODELS='{{\"even\": \"{path.resolve()}\"}}'")
