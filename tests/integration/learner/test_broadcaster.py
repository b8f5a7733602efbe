"""learner.broadcaster against a real Redis board: nothing sent without members, and a member that never
joins costs the learner its timeout, then is dropped (it loads the version's files instead)."""

from __future__ import annotations

import uuid


async def test_a_broadcast_without_members_sends_nothing(redis):
    from broker import Keys
    from learner.broadcaster import Broadcaster
    from services.config import PublishConfig

    keys = Keys(f"broadcast-{uuid.uuid4().hex[:8]}")
    assert await Broadcaster(redis, keys, PublishConfig(transport="broadcast"), "127.0.0.1").send(1, {}) is None


async def test_a_member_that_never_joins_is_dropped_and_the_learner_goes_on(redis):
    import time

    import torch

    from broker import Keys
    from broker.broadcast import BroadcastBoard
    from learner.broadcaster import Broadcaster
    from services.config import PublishConfig

    keys = Keys(f"broadcast-{uuid.uuid4().hex[:8]}")
    board = BroadcastBoard(redis, keys)
    await board.join("gone", 1)  # its heartbeat is fresh, but it will not come
    t0 = time.monotonic()
    sent = await Broadcaster(redis, keys, PublishConfig(transport="broadcast", broadcast_timeout_s=2), "127.0.0.1").send(
        1, {"w": torch.zeros(4)})
    assert time.monotonic() - t0 < 20
    assert sent.digest is None and sent.error and sent.members == ["gone"]
    assert await board.members() == {}  # dropped until it joins again
