"""One deterministic optimizer step without a broker: for equivalence checks.

    python -m tests.selfcheck --model DIR --out W.safetensors [--zero-stage 0,2,3] [--steps 1]
    python -m tests.selfcheck --model DIR --out UNUSED --plan runs.json
    torchrun --nproc_per_node 2 -m tests.selfcheck --model DIR --out W.safetensors

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


PROBE = [5, 17, 23, 40, 8, 9, 12, 33, 61, 2]
"""A fixed token sequence whose log-probs the trained engine reports (to compare with vLLM)."""


def probe_logprobs(engine) -> list[float]:
    """log p(PROBE[i+1] | PROBE[:i+1]) under the engine's current weights (collective under ZeRO-3)."""
    import torch

    from learner.loss import token_logprobs

    ids = torch.tensor([PROBE], device=engine.device)
    engine.engine.eval()
    with torch.no_grad():
        logits = engine.engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        lp = token_logprobs(logits[:, :-1].float() / engine.cfg.sampling.temperature, ids[:, 1:])
    engine.engine.train()
    return lp[0].tolist()


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


def run_one(model: Path, out: Path, stage: int, steps: int, overrides: dict) -> None:
    """Train ``steps`` steps on the synthetic batches with ZeRO ``stage``; rank 0 writes ``out``."""
    import torch

    from learner.batch import build_batch, split_ranks
    from learner.engine import LearnerEngine
    from services.weightstore import write_safetensors

    overrides = json.loads(json.dumps(overrides))
    overrides.setdefault("learner", {})["zero_stage"] = stage
    cfg = selfcheck_config(model, overrides)
    engine = LearnerEngine(cfg)
    stats = []
    for step in range(steps):
        groups = synthetic_groups(engine.vocab_size, 4, 4, seed=step)
        seqs = build_batch(groups, cfg.loss, cfg.sampling.max_tokens)
        share = split_ranks(seqs, engine.world)[engine.rank]
        stats.append(engine.train_step(share))
    probe = probe_logprobs(engine)
    adapter = None
    if cfg.publish.lora_format == "adapter":
        from learner.publisher import publish_tensors
        from services.weightstore import write_version

        tensors, layout = publish_tensors(engine, cfg, torch.float32)
        if engine.rank == 0:
            adapter = write_version(out.parent / f"{out.stem}-adapter", 1, tensors, replace=True, **layout).path
    weights = engine.full_state_dict(torch.float32)
    if engine.rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(out, weights)
        Path(f"{out}.json").write_text(
            json.dumps({"world": engine.world, "stage": stage, "stats": stats, "probe": PROBE, "probe_logprobs": probe,
                        "adapter": None if adapter is None else str(adapter)})
        )
    torch.distributed.barrier()
    engine.engine.destroy()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="Weights file; with several stages, OUT.stageN.safetensors.")
    ap.add_argument("--zero-stage", default="0", help="One stage or a comma-separated list, run one after another.")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--overrides", default="{}", help="JSON {section: {field: value}} applied to the run config.")
    ap.add_argument("--plan", type=Path, help="JSON list of {stage, steps, overrides, out}: several runs in one process.")
    args = ap.parse_args(argv)
    if args.plan:
        for run in json.loads(args.plan.read_text()):
            run_one(args.model, Path(run["out"]), run.get("stage", 0), run.get("steps", 1), run.get("overrides", {}))
        return
    stages = [int(x) for x in args.zero_stage.split(",")]
    for stage in stages:
        out = args.out if len(stages) == 1 else args.out.with_name(f"{args.out.stem}.stage{stage}.safetensors")
        run_one(args.model, out, stage, args.steps, json.loads(args.overrides))


if __name__ == "__main__":
    main()
