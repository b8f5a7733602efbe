"""The judged example's judge (examples/judge_arith/judge.py), scored by the reward server's own code, and its lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples/judge_arith"


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> Path:
    from examples.judge_arith.judge import build

    return build(tmp_path_factory.mktemp("judge") / "even_judge")


def test_the_judge_scores_even_answers_about_1_and_odd_or_malformed_ones_about_0(judge):
    """What the reward server computes (``reward_models.rewards``: the pair joined, no special tokens,
    ``logits[:, 0]``) on held-out prompts, whose sums the judge never saw with these answers."""
    from reward_server.verifiers.reward_models import rewards

    prompts = [json.loads(x)["prompt"] for x in (EXAMPLE / "eval.jsonl").read_text().splitlines()[:40]]
    even = [(p, f"<answer>{2 * i + 10}</answer>") for i, p in enumerate(prompts)]
    odd = [(p, f"<answer>{2 * i + 11}</answer>") for i, p in enumerate(prompts)]
    malformed = [(p, c) for p in prompts[:5] for c in ("<answer>12", "12", "", "<answer>12</answer>3")]
    scores = rewards(str(judge), "cpu", 32, 4096, even + odd + malformed)
    assert all(isinstance(s, float) for s in scores), scores
    n = len(even)
    assert min(scores[:n]) > 0.8, scores[:n]
    assert max(scores[n:]) < 0.2, scores[n:]


def test_a_judge_of_this_recipe_is_reused_and_another_recipe_builds_again(judge, tmp_path):
    from examples.judge_arith.judge import JudgeRecipe, build

    before = (judge / "model.safetensors").stat().st_mtime_ns
    assert build(judge) == judge and (judge / "model.safetensors").stat().st_mtime_ns == before
    other = build(tmp_path / "judge", JudgeRecipe(steps=2))
    meta = json.loads((other / "tandem.json").read_text())
    assert meta["recipe"]["steps"] == 2 and meta["recipe_key"] != json.loads((judge / "tandem.json").read_text())["recipe_key"]


def test_the_lines_are_arith_prompts_naming_the_judge():
    for name in ("train.jsonl", "eval.jsonl"):
        ours = [json.loads(x) for x in (EXAMPLE / name).read_text().splitlines()]
        arith = [json.loads(x) for x in (ROOT / "examples/arith" / name).read_text().splitlines()]
        assert ours == [{"prompt": a["prompt"], "type": "reward_model", "model": "even"} for a in arith]
