"""Building :class:`~services.wire.ScoreResult` values the same way in every verifier."""

from __future__ import annotations

from services.wire import INFRA_STATUSES, ScoreResult, ScoreStatus

DETAIL_CHARS = 2000


def scored(item_id: str, reward: float, status: ScoreStatus, detail: str = "",
           components: dict[str, float] | None = None) -> ScoreResult:
    return ScoreResult(id=item_id, reward=float(reward), status=status, detail=detail[:DETAIL_CHARS],
                       components=components or {})


def infra(item_id: str, status: ScoreStatus, detail: str) -> ScoreResult:
    """An infrastructure failure: no reward."""
    assert status in INFRA_STATUSES
    return ScoreResult(id=item_id, reward=None, status=status, detail=detail[:DETAIL_CHARS])
