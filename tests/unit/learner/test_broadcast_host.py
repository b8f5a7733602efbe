"""A learner with no address the rollout servers reach (``TANDEM_LEARNER_BROADCAST_HOST`` empty: a Modal deploy
without ``[modal].i6pn``) publishes a broadcast run's versions as files, never announcing a group that no
member could join. Before: it announced ``127.0.0.1`` (or nothing usable) to members in other containers
and waited out ``publish.broadcast_timeout_s`` for each version."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import RunConfig


def _config(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate({"name": "b", "model": {"path": str(tmp_path)}, "data": {"train": "t.jsonl"},
                                     "publish": {"transport": "broadcast"}})


@pytest.mark.parametrize(("host", "broadcasts"), [("", False), ("127.0.0.1", True)])
def test_an_empty_broadcast_host_publishes_files_only(monkeypatch, tmp_path, host, broadcasts):
    from broker import Keys
    from learner.publisher import Broadcaster, Publisher
    from learner.settings import LearnerSettings

    monkeypatch.setenv("TANDEM_LEARNER_BROADCAST_HOST", host)
    publisher = Publisher(None, _config(tmp_path), LearnerSettings(), None, Keys("b-1"), None, weights=tmp_path,
                          published_log=tmp_path / "published.jsonl", status=None, metrics=None, timeline=None)
    assert isinstance(publisher.broadcaster, Broadcaster) == broadcasts
