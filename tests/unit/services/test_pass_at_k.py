"""pass@k (Chen et al. 2021) against brute force, and which k an evaluation reports."""

from __future__ import annotations

import itertools
import math

import pytest

from services.evaluate import pass_at_k, pass_ks


def brute_force(outcomes: list[bool], k: int) -> float:
    """The fraction of the k-subsets of ``outcomes`` that hold a correct completion."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_estimator_equals_brute_force_over_every_subset(n):
    for c in range(n + 1):
        for order in {tuple(i < c for i in range(n)), tuple(i >= n - c for i in range(n))}:
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(list(order), k), abs=1e-12), (n, c, k)


def test_closed_form_and_large_n():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c/n
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 1, 10) == 1.0
    exact = 1 - math.comb(200 - 7, 100) / math.comb(200, 100)  # binomials of 60 digits: the product stays exact
    assert pass_at_k(200, 7, 100) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_out_of_range_is_refused(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_reported_ks():
    assert pass_ks(1) == []
    assert pass_ks(2) == [1, 2]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(10) == [1, 2, 4, 8, 10]
