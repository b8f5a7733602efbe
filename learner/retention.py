"""The learner's policy for the weight store: which published versions stay on disk.

The format of a published version (directory naming, safetensors writing,
the sha256 checksum, the ``tandem-version.json`` record, atomic writes)
belongs to ``services.weightstore``, which the publisher (``learner.publisher``)
writes with and the rollout servers read with.

What is kept (``[publish]``, :func:`retained`): the newest ``keep`` versions
(the rolling window the rollout servers load from), every version a rollout
server still serves, every ``keep_every``-th version for good, and the
``keep_best`` versions with the highest held-out score. Scores come from the
run's evaluation results (``services.evaluate.EvalLog``), recorded after a
rollout server has loaded and evaluated a version, so usually after the
version left the window: a version due for evaluation is therefore kept until
it is scored. The rollout servers evaluate in version order, so once a newer
version has a score, an older one still without a score will not get one (its
evaluation failed or was skipped) and is judged by the other rules alone.

The publisher records each decision in ``<run>/weights/retention.json``
(:data:`RETENTION_FILE`: the scores it knew and the versions kept), which
``tandem export`` reads to find the best version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

RUN_CONFIG_FILE = "run-config.json"
"""Beside ``weights/``: the run config the learner trains with (JSON, paths absolute), written at start."""
RETENTION_FILE = "retention.json"
"""In the weights directory: ``{"scores": {version: score}, "kept": [...], "best": [...]}``."""


def best(scores: Mapping[int, float], n: int, among: Iterable[int] | None = None) -> list[int]:
    """The ``n`` versions with the highest score (of those in ``among``, if given), best first;
    between equal scores the newer version ranks first."""
    pool = set(scores) if among is None else set(scores) & set(among)
    return sorted(pool, key=lambda v: (scores[v], v), reverse=True)[:n]


def retained(
    history: Iterable[int],
    keep: int,
    in_use: Iterable[int],
    *,
    keep_every: int = 0,
    keep_best: int = 0,
    scores: Mapping[int, float] | None = None,
    due: Callable[[int], bool] | None = None,
) -> tuple[set[int], set[int]]:
    """(versions to keep, versions to delete) among ``history``.

    Kept: the newest ``keep``; any version a rollout server still serves (``in_use``) however old,
    so a lagging server never loses the files of the weights it is generating with; with
    ``keep_every`` every multiple of it; with ``keep_best`` the best-scored ``keep_best`` (``scores``:
    version -> held-out score) and every version that ``due`` says is evaluated but that has no score
    yet while no newer version has one (see the module docstring).
    """
    versions = sorted(set(history))
    keep_set = set(versions[-keep:]) | (set(in_use) & set(versions))
    if keep_every:
        keep_set |= {v for v in versions if v % keep_every == 0}
    if keep_best:
        scores = scores or {}
        keep_set |= set(best(scores, keep_best, among=versions))
        newest_scored = max(scores, default=-1)
        if due is not None:
            keep_set |= {v for v in versions if v > newest_scored and due(v)}
    return keep_set, set(versions) - keep_set
