"""The pure parts of a weight broadcast: the seat URI, the seating, and the config's checks."""

from __future__ import annotations

import pytest

from broker.broadcast import seat
from services.weightgroup import Invitation


def test_an_invitation_survives_its_uri():
    inv = Invitation("10.0.0.7", 45135, "v12", 3, 5, 60.0)
    assert inv.uri == "broadcast://10.0.0.7:45135/v12?rank=3&world=5&timeout=60"
    assert Invitation.parse(inv.uri) == inv


@pytest.mark.parametrize("uri", [
    "file:///tmp/v1",
    "broadcast://h:1/v1?rank=1&world=2",  # no timeout
    "broadcast://h:1/v1?rank=0&world=2&timeout=5",  # rank 0 is the learner's
    "broadcast://h:1/v1?rank=2&world=2&timeout=5",  # outside the world
    "broadcast://h/v1?rank=1&world=2&timeout=5",  # no port
    "broadcast://h:1/?rank=1&world=2&timeout=5",  # no group
])
def test_a_malformed_invitation_is_refused(uri):
    with pytest.raises(ValueError):
        Invitation.parse(uri)


def test_servers_are_seated_after_the_learner_with_one_rank_per_worker():
    assert seat({"b": 2, "a": 1, "dp": 0}) == ({"a": 1, "b": 2}, 4)
    assert seat({}) == ({}, 1)


def test_broadcast_is_a_full_weight_transport(tmp_path):
    from services.config import RunConfig

    base = {"model": {"path": str(tmp_path)}, "data": {"train": str(tmp_path / "t.jsonl")}}
    assert RunConfig.model_validate(base).publish.transport == "files"
    assert RunConfig.model_validate({**base, "publish": {"transport": "broadcast"}}).publish.transport == "broadcast"
    with pytest.raises(ValueError, match="transport"):
        RunConfig.model_validate({**base, "publish": {"transport": "nccl"}})
    with pytest.raises(ValueError, match="lora_format = 'merged'"):
        RunConfig.model_validate({**base, "learner": {"lora": {"r": 8}},
                                  "publish": {"transport": "broadcast", "lora_format": "adapter"}})
