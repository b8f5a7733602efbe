"""The judged example's cold start: the arith example's policy, and the judge beside it.

``model.bootstrap = "judge_arith"`` in run.toml: ``tandem run`` builds, where ``model.path`` points, the
policy of ``examples.arith.bootstrap`` cold-started on examples/arith/train.jsonl (the lines that carry
answers; this example's lines carry none, only the judge's name), the same model the arith example builds
and reuses, and in the folder beside it named :data:`JUDGE` the judge of :mod:`examples.judge_arith.judge`.
The reward server is told where the judge is by its operator, you: ``TANDEM_REWARD_MODELS``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from examples.arith import bootstrap as arith
from examples.judge_arith import judge

SFT_STEPS = arith.SFT_STEPS
ARITH_DATA = Path(__file__).parents[1] / "arith" / "train.jsonl"
JUDGE = "even_judge"
"""The judge's folder, beside the policy's (``runs/models/even_judge`` for the example's run.toml)."""


def judge_dir(out: str | Path) -> Path:
    return Path(out).with_name(JUDGE)


def check_data(data: str | Path) -> None:
    """Nothing to check in the run's lines: the policy learns from the arith example's."""


def is_built(out: str | Path, data: str | Path) -> bool:
    return arith.is_built(out, ARITH_DATA) and judge.is_cached(judge_dir(out), judge.JudgeRecipe())


def bootstrap(out: str | Path, data: str | Path, *, steps: int = SFT_STEPS, seed: int = 0,
              progress: Callable[[int, int, float], None] | None = None) -> Path:
    """The policy at ``out`` (``data`` unused: see the module's docstring), then the judge beside it."""
    path = arith.bootstrap(out, ARITH_DATA, steps=steps, seed=seed, progress=progress)
    judge.build(judge_dir(out))
    return path
