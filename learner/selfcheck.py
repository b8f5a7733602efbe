"""One deterministic optimizer step without a broker: for equivalence checks.

    python -m learner.selfcheck --model DIR --out W.safetensors [--zero-stage 3] [--steps 1]
    torchrun --nproc_per_node 2 -m learner.selfcheck --model DIR --out W.safetensors

Builds a fixed synthetic batch of trajectory groups (seeded: every rank and
every run builds the same one), trains ``--steps`` steps on it with the given
ZeRO stage, and writes the resulting full weights (rank 0) plus the step
statistics (``W.safetensors.json``). The ZeRO-0/2/3 and 1-vs-2-rank tests
compare the weights of such runs; it is also a quick way to check that
DeepSpeed works on a machine.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from services.config import RunConfig
from services.wire import ScoredSample, TrajectoryGroup


def synthetic_groups(vocab: int, n_groups: int, group_size: int, seed: int, version: int = 0) -> list[TrajectoryGroup]:
    """``n_groups`` groups with varied prompt/completion lengths, rewards and behaviour log-probs."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        samples = []
        for _ in range(group_size):
            n = rng.randint(1, 9)
            samples.append(
                ScoredSample(
                    token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(3.0, 6.0) for _ in range(n)],
                    text="",
                    finish_reason=rng.choice(["stop", "length"]),
                    policy_version=version,
                    reward=float(rng.randint(0, 1)) if g % 3 else rng.random(),
                    status="ok",
                )
            )
        groups.append(
            TrajectoryGroup(
                run_id="selfcheck", group_id=f"g{seed}-{g}", prompt="", prompt_token_ids=prompt,
                samples=samples, n=group_size, policy_version=version,
            )
        )
    return groups


def selfcheck_config(model: Path, overrides: dict | None = None) -> RunConfig:
    data = {
        "name": "selfcheck",
        "model": {"path": str(model)},
        "data": {"train": "unused.jsonl"},
        "learner": {"zero_stage": 0, "lr": 1e-3, "micro_batch_tokens": 64, "grad_clip": 1.0},
        "loss": {"beta": 0.0},
    }
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return RunConfig.model_validate(data)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--overrides", default="{}", help="JSON {section: {field: value}} applied to the run config.")
    args = ap.parse_args(argv)

    import torch

    from learner.batch import build_batch, split_ranks
    from learner.engine import Engine
    from learner.weights import write_safetensors

    overrides = json.loads(args.overrides)
    overrides.setdefault("learner", {})["zero_stage"] = args.zero_stage
    cfg = selfcheck_config(args.model, overrides)
    engine = Engine(cfg)
    stats = []
    for step in range(args.steps):
        groups = synthetic_groups(engine.vocab_size, 4, 4, seed=step)
        seqs = build_batch(groups, cfg.loss, cfg.sampling.max_tokens)
        share = split_ranks(seqs, engine.world)[engine.rank]
        stats.append(engine.train_step(share))
    weights = engine.full_state_dict(torch.float32)
    if engine.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(args.out, weights)
        Path(f"{args.out}.json").write_text(json.dumps({"world": engine.world, "stats": stats}))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
