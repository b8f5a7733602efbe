"""Stall incidents (issue 27): a real process beating through services.timeline is stopped with SIGSTOP for a
few seconds; the control plane's StallMonitor records one incident with the silence's length and a
``stalled`` span on that service's timeline, none for a service that kept beating, and a service still
silent when the run ends is recorded then."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from broker import Keys, connect
from broker.embedded import EmbeddedRedis
from control_plane.stalls import StallMonitor
from services import timeline
from services.runs import RunStore
from services.watchdog import IncidentLog

BEATER = """
import sys, time
from broker.keys import Keys
from services.timeline import Timeline
t = Timeline(sys.argv[1], Keys(sys.argv[2]), sys.argv[3], flush_s=0.1).start()
time.sleep(120)
"""


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of this test's own: the run it creates becomes the stack's one active run."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    yield server.url
    server.stop()


async def _wait(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_a_stopped_process_is_recorded_as_a_stall(own_redis):
    redis = connect(own_redis)
    run_id = "stall-run"
    keys = Keys(run_id)
    await RunStore(redis).create(run_id, "ps", {"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                                                "watchdog": {"stall_s": 1.0}})
    procs = [subprocess.Popen([sys.executable, "-c", BEATER, own_redis, run_id, name], start_new_session=True)
             for name in ("learner", "rollout:r0")]
    monitor = StallMonitor(redis, poll_s=0.1).start()
    try:
        await _wait(lambda: _beating(redis, keys, 2))
        await asyncio.sleep(0.5)
        learner = procs[0]
        os.kill(learner.pid, signal.SIGSTOP)
        stopped = time.time()
        await asyncio.sleep(3.0)
        os.kill(learner.pid, signal.SIGCONT)
        resumed = time.time()
        await _wait(lambda: _incidents(redis, keys, 1))
        [inc] = await IncidentLog(redis, keys).recent()
        assert inc.source == "learner" and inc.field == "watchdog.stall_s" and inc.limit_s == 1.0
        assert 2.5 <= inc.waited_s <= resumed - stopped + 1.0, inc
        assert "beat again" in inc.action
        [span] = [s for s in await timeline.read(redis, keys) if s.name == "stalled"]
        assert (span.service, span.track) == ("learner", "stalled") and span.attrs["resumed"] is True
        assert abs((span.end - span.start) - inc.waited_s) < 1e-6

        # silent when the run ends: recorded then
        os.kill(learner.pid, signal.SIGSTOP)
        await asyncio.sleep(2.0)
        await RunStore(redis).stop(run_id)
        await _wait(lambda: _incidents(redis, keys, 2))
        newest = (await IncidentLog(redis, keys).recent())[0]
        assert newest.source == "learner" and "did not beat again" in newest.action and newest.waited_s >= 1.5
        assert all(i.source != "rollout:r0" for i in await IncidentLog(redis, keys).recent())
    finally:
        await monitor.stop()
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        await redis.aclose()


async def _beating(redis, keys, n: int) -> bool:
    return await redis.hlen(keys.heartbeats) >= n


async def _incidents(redis, keys, n: int) -> bool:
    return len(await IncidentLog(redis, keys).recent()) >= n


async def test_a_beat_stamped_before_the_stop_but_sent_after_it_does_not_end_the_silence(own_redis):
    """The beater thread stamps ``time.time()`` and then sends it; a SIGSTOP between the two delivers, on
    SIGCONT, a beat from before the silence. Seen in CI as a 0.1 s "stall": the silence lasts until a fresh beat."""
    redis = connect(own_redis)
    keys = Keys("late-beat")
    monitor = StallMonitor(redis)
    monitor.bound_s = 1.0
    try:
        for stamp, now in ((100.0, 100.1), (100.0, 102.0), (100.1, 103.0)):  # beats, stops, sends a stale beat
            await redis.hset(keys.heartbeats, "learner", repr(stamp))
            await monitor.check(keys, now)
        assert await IncidentLog(redis, keys).recent() == []
        await redis.hset(keys.heartbeats, "learner", repr(103.2))  # the first beat stamped after it resumed
        await monitor.check(keys, 103.3)
        [inc] = await IncidentLog(redis, keys).recent()
        assert abs(inc.waited_s - 3.2) < 1e-9 and "beat again" in inc.action
    finally:
        await redis.aclose()
