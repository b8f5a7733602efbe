"""learner.publisher.Broadcaster against a real Redis board: nothing sent without members, and a member that never
joins costs the learner its timeout, then is dropped (it loads the version's files instead)."""

from __future__ import annotations

import uuid

from pydantic import SecretStr

from services.weightgroup import broadcast_key

KEY = broadcast_key(SecretStr("broadcaster-test-token"))


async def test_a_broadcast_without_members_sends_nothing(redis):
    from broker import Keys
    from learner.publisher import Broadcaster
    from services.config import PublishConfig

    keys = Keys(f"broadcast-{uuid.uuid4().hex[:8]}")
    assert await Broadcaster(redis, keys, PublishConfig(transport="broadcast"), "127.0.0.1", KEY).send(1, {}) is None


async def test_a_member_that_never_joins_is_dropped_and_the_learner_goes_on(redis):
    import time

    import torch

    from broker import Keys
    from broker.broadcast import BroadcastBoard
    from learner.publisher import Broadcaster
    from services.config import PublishConfig

    keys = Keys(f"broadcast-{uuid.uuid4().hex[:8]}")
    board = BroadcastBoard(redis, keys)
    await board.join("gone", 1)  # its heartbeat is fresh, but it will not come
    t0 = time.monotonic()
    sent = await Broadcaster(redis, keys, PublishConfig(transport="broadcast", broadcast_timeout_s=2), "127.0.0.1", KEY).send(
        1, {"w": torch.zeros(4)})
    assert time.monotonic() - t0 < 20
    assert sent.digest is None and sent.error and sent.members == ["gone"]
    assert await board.members() == {}  # dropped until it joins again


MEMBER = """
import sys, time
from services.weightgroup import WeightGroup
host, port, rank, world, group = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
WeightGroup(host, port, rank, world, key=bytes.fromhex(sys.argv[6]), timeout_s=60.0, name=group)._group()
print("joined", flush=True)
time.sleep(600)  # a server stuck mid-broadcast, until it is killed
"""


async def test_a_server_killed_mid_broadcast_is_dropped_and_the_learner_goes_on(redis):
    import asyncio
    import subprocess
    import sys
    import time

    import torch

    from broker import Keys
    from broker.broadcast import BroadcastBoard
    from learner.publisher import Broadcaster
    from services.config import PublishConfig

    keys = Keys(f"broadcast-{uuid.uuid4().hex[:8]}")
    board = BroadcastBoard(redis, keys)
    await board.join("doomed", 1)
    learner = Broadcaster(redis, keys, PublishConfig(transport="broadcast", broadcast_timeout_s=5), "127.0.0.1", KEY)
    sending = asyncio.create_task(learner.send(1, {f"w{i}": torch.zeros(1 << 18) for i in range(16)}))
    a = await board.wait_seat("doomed", 0, timeout_s=30)
    member = subprocess.Popen([sys.executable, "-c", MEMBER, a.host, str(a.port), str(a.seats["doomed"]),
                               str(a.world), a.group, KEY.hex()], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert (await asyncio.to_thread(member.stdout.readline)).strip() == "joined"
        member.kill()
        t0 = time.monotonic()
        sent = await asyncio.wait_for(sending, 30)
        assert time.monotonic() - t0 < 20
    finally:
        member.kill()
        member.wait()
    assert sent.digest is None and sent.error and sent.members == ["doomed"]
    assert await board.members() == {}
