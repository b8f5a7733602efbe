"""The learner's retention policy (learner.retention): which published versions stay on disk."""

from __future__ import annotations

from learner.retention import best, retained


def test_retention_keeps_the_newest_and_versions_in_use():
    keep, delete = retained([1, 2, 3, 4, 5], keep=2, in_use=[2, 9])
    assert keep == {2, 4, 5} and delete == {1, 3}
    keep, delete = retained([5, 3, 3], keep=4, in_use=[])
    assert keep == {3, 5} and delete == set()
    keep, delete = retained([1, 2, 3], keep=1, in_use=[1, 2, 3])
    assert keep == {1, 2, 3} and delete == set()


def test_keep_every_keeps_multiples_for_good():
    keep, delete = retained(range(1, 11), keep=2, in_use=[], keep_every=4)
    assert keep == {4, 8, 9, 10} and delete == {1, 2, 3, 5, 6, 7}


def test_keep_best_keeps_the_best_scored_versions_and_prefers_the_newer_on_a_tie():
    scores = {0: 0.9, 2: 0.5, 4: 0.8, 6: 0.8, 8: 0.1}  # version 0 (the base model) is never on disk
    keep, _ = retained(range(1, 11), keep=1, in_use=[], keep_best=1, scores=scores, due=lambda v: v % 2 == 0)
    assert keep == {6, 10}  # 6 and 4 tie: the newer; 10 is due and unscored, newer than every score
    keep, _ = retained(range(1, 11), keep=1, in_use=[], keep_best=2, scores=scores, due=lambda v: v % 2 == 0)
    assert keep == {4, 6, 10}
    assert best(scores, 2) == [0, 6] and best(scores, 2, among=range(1, 11)) == [6, 4]


def test_a_version_due_for_evaluation_is_kept_until_a_newer_one_is_scored():
    due = lambda v: v % 2 == 0  # noqa: E731
    # 4 and 6 wait for their scores (a rollout server evaluates after loading, past the window)
    keep, delete = retained(range(1, 8), keep=1, in_use=[], keep_best=1, scores={2: 0.3}, due=due)
    assert keep == {2, 4, 6, 7} and delete == {1, 3, 5}
    # 6 was scored but 4 never was (its evaluation failed): 4 is judged by the other rules alone
    keep, delete = retained(range(1, 8), keep=1, in_use=[], keep_best=1, scores={2: 0.3, 6: 0.1}, due=due)
    assert keep == {2, 7} and delete == {1, 3, 4, 5, 6}
    # without keep_best nothing waits for a score
    keep, _ = retained(range(1, 8), keep=1, in_use=[], scores={2: 0.3}, due=due)
    assert keep == {7}
