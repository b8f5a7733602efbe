"""The learner's retention policy (learner.weights): which published versions stay on disk."""

from __future__ import annotations

from learner.weights import retained


def test_retention_keeps_the_newest_and_versions_in_use():
    keep, delete = retained([1, 2, 3, 4, 5], keep=2, in_use=[2, 9])
    assert keep == {2, 4, 5} and delete == {1, 3}
    keep, delete = retained([5, 3, 3], keep=4, in_use=[])
    assert keep == {3, 5} and delete == set()
    keep, delete = retained([1, 2, 3], keep=1, in_use=[1, 2, 3])
    assert keep == {1, 2, 3} and delete == set()
