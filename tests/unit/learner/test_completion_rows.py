"""The completions table's rows of a step (learner.trainer.completion_rows; ``logging.completions``)."""

from __future__ import annotations

import pytest

from learner.trainer import completion_rows
from services.wire import ScoredSample, TrajectoryGroup


def sample(text: str, reward: float, version: int = 3, logged: dict | None = None) -> ScoredSample:
    return ScoredSample(token_ids=[7], logprobs=[-1.0], text=text, finish_reason="stop", policy_version=version,
                        reward=reward, status="ok", logged=logged or {})


def group(gid: str, prompt: str, samples: list[ScoredSample]) -> TrajectoryGroup:
    return TrajectoryGroup(run_id="r", group_id=gid, prompt=prompt, prompt_token_ids=[5], samples=samples,
                           n=len(samples), policy_version=min(s.policy_version for s in samples))


def test_rows_take_each_groups_samples_in_turn_with_their_advantage_and_logged_columns():
    a = group("a", "1+1=", [sample("2", 1.0, logged={"tokens": 1}), sample("3", 0.0, logged={"tokens": 1})])
    b = group("b", "2+2=", [sample("4", 1.0, version=2), sample("5", 0.0), sample("9", 0.0)])
    rows = completion_rows([a, b], step=7, n=3, advantage="dr_grpo")
    assert [(r["group_id"], r["completion"]) for r in rows] == [("a", "2"), ("b", "4"), ("a", "3")]
    assert rows[0] == {"step": 7, "version": 3, "group_id": "a", "prompt": "1+1=", "completion": "2", "reward": 1.0,
                       "advantage": 0.5, "logged": {"tokens": 1}}
    assert rows[1]["version"] == 2 and rows[1]["advantage"] == pytest.approx(2 / 3) and rows[1]["logged"] == {}
    assert len(completion_rows([a, b], step=7, n=100, advantage="grpo")) == 5
    assert completion_rows([a, b], step=7, n=0, advantage="grpo") == []
