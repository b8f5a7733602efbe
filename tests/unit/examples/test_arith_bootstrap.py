"""The example's cold start: its answer key (the carry slip) and its learning-rate schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.arith.bootstrap import CARRY_SLIP, SFT_STEPS, has_carry, load_pairs, lr_factor, slip

TRAIN = Path(__file__).resolve().parents[3] / "examples/arith/train.jsonl"


@pytest.mark.parametrize(("prompt", "carry"), [
    ("12+34=", False), ("50+49=", False), ("17+25=", True), ("60+50=", True), ("95+15=", True),
    ("what is 17+25?", False),  # not an a+b= prompt: left as it is
])
def test_has_carry(prompt, carry):
    assert has_carry(prompt) is carry


def test_the_slip_makes_the_share_of_carry_answers_ten_short_and_touches_nothing_else():
    pairs = load_pairs(TRAIN)
    slipped = slip(pairs, CARRY_SLIP, seed=0)
    assert [p for p, _ in slipped] == [p for p, _ in pairs]
    short = [int(a) - int(b) for (p, a), (_, b) in zip(pairs, slipped, strict=True) if has_carry(p)]
    assert set(short) == {0, 10}
    assert abs(short.count(10) / len(short) - CARRY_SLIP) < 0.02
    assert all(a == b for (p, a), (_, b) in zip(pairs, slipped, strict=True) if not has_carry(p))
    assert slip(pairs, CARRY_SLIP, seed=0) == slipped != slip(pairs, CARRY_SLIP, seed=1)


def test_the_learning_rate_warms_up_then_decays_to_zero_at_the_last_step():
    assert lr_factor(0, SFT_STEPS) == pytest.approx(1 / 50)
    assert lr_factor(50, SFT_STEPS) == pytest.approx(1.0)
    factors = [lr_factor(s, SFT_STEPS) for s in range(50, SFT_STEPS)]
    assert factors == sorted(factors, reverse=True)
    assert factors[-1] < 1e-4


def test_a_model_built_by_another_recipe_is_built_again(tmp_path):
    """`tandem run` rebuilds runs/models/arith when the recipe changed (not just when it is missing)."""
    import json

    from examples.arith.bootstrap import is_built, recipe_for

    assert not is_built(tmp_path, TRAIN)
    (tmp_path / "tandem.json").write_text(json.dumps({"recipe_key": recipe_for(TRAIN).key()}))
    assert is_built(tmp_path, TRAIN)
    (tmp_path / "tandem.json").write_text(json.dumps({"recipe_key": recipe_for(TRAIN, steps=SFT_STEPS - 1).key()}))
    assert not is_built(tmp_path, TRAIN)
