"""The learner's rank protocol (learner.ranks): one command type, its invariants checked where it is made."""

from __future__ import annotations

import pickle

import pytest

from learner.ranks import RankChannel, RankCommand


def test_a_stop_does_nothing_else_and_only_a_stop_can_fail():
    RankCommand(step=3, stop=True, failed=True)
    with pytest.raises(ValueError, match="stop"):
        RankCommand(step=3, failed=True)
    for extra in ({"publish": True}, {"checkpoint": True}, {"rows": [[], []]}):
        with pytest.raises(ValueError, match="nothing else"):
            RankCommand(step=3, stop=True, **extra)


def test_a_command_survives_the_broadcast_unchanged():
    cmd = RankCommand(step=4, rows=[[], []], publish=True, checkpoint=True)
    assert pickle.loads(pickle.dumps(cmd)) == cmd  # broadcast_object_list pickles it


def test_nothing_is_sent_after_a_stop():
    ranks = RankChannel(world=1)  # one rank: no broadcast, the bookkeeping still holds
    ranks.send(RankCommand(step=1, rows=[[]]))
    assert not ranks.stopped
    ranks.send(RankCommand(step=1, stop=True))
    assert ranks.stopped
    with pytest.raises(RuntimeError, match="told to stop"):
        ranks.send(RankCommand(step=2, rows=[[]]))
