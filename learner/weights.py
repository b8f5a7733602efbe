"""The learner's policy for the weight store: which published versions stay on disk.

The format of a published version (directory naming, safetensors writing,
the sha256 checksum, the ``tandem-version.json`` record, atomic writes)
belongs to ``services.weightstore``, which the trainer writes with and the
rollout servers read with.
"""

from __future__ import annotations

from collections.abc import Iterable


def retained(history: Iterable[int], keep: int, in_use: Iterable[int]) -> tuple[set[int], set[int]]:
    """(versions to keep, versions to delete) among ``history``: the newest ``keep``, and any
    version a rollout server still serves (``in_use``) however old, so a lagging server never
    loses the files of the weights it is generating with."""
    versions = sorted(set(history))
    keep_set = set(versions[-keep:]) | (set(in_use) & set(versions))
    return keep_set, set(versions) - keep_set
