"""The embedded redis-server: durability across kill -9, no orphans, REDIS_URL override."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from broker import Envelope, Keys, Stream, connect
from broker.embedded import EmbeddedRedis


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is gone for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


async def test_kill_9_and_restart_on_the_same_aof_loses_no_queued_group(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    keys = Keys("durable")
    redis = connect(server.url)
    stream = Stream.trajectories(redis, keys)
    await stream.ensure_group()
    ids = [f"g{i}" for i in range(200)]
    for gid in ids:
        await stream.add(Envelope(gid, 1, os.urandom(2048)))  # acknowledged by Redis = queued
    in_flight = await stream.read("learner", count=10, block_ms=None)  # pending, not acked
    server.kill()  # SIGKILL right after the last reply: no clean shutdown
    await redis.aclose()

    restarted = EmbeddedRedis(tmp_path / "redis", port=server.port).start()
    redis = connect(restarted.url)
    try:
        stream = Stream.trajectories(redis, keys, visibility_timeout_s=0)
        assert await stream.backlog() == 200
        assert await stream.pending() == 10
        got = []
        while batch := await stream.read("learner-2", count=50, block_ms=None):
            got += [d.envelope.group_id for d in batch]
            await stream.ack(batch)
        assert sorted(got) == sorted(ids)
        assert {d.envelope.group_id for d in in_flight} <= set(got)
    finally:
        await redis.aclose()
        restarted.stop()


def test_no_orphan_when_the_owner_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from broker.embedded import EmbeddedRedis
        server = EmbeddedRedis({str(tmp_path)!r}).start()
        print(server.proc.pid, flush=True)
        time.sleep(3600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    redis_pid = int(owner.stdout.readline())
    assert _alive(redis_pid)
    owner.send_signal(signal.SIGKILL)  # no cleanup code runs in the owner
    owner.wait()
    deadline = time.monotonic() + 10
    while _alive(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(redis_pid), "redis-server outlived its owner"


def test_stop_ends_the_process_group(tmp_path):
    server = EmbeddedRedis(tmp_path).start()
    pid = server.proc.pid
    assert os.getpgid(pid) == pid  # its own process group
    server.stop()
    assert not _alive(pid)
    assert (tmp_path / "appendonlydir").is_dir()  # AOF lives in the data dir


async def test_a_client_rides_out_a_restart_and_a_wrong_password_fails_at_once(tmp_path):
    """broker.connect retries a lost connection (a Redis restarted on its AOF is a pause), but not a refusal."""
    import asyncio

    import pytest
    from redis.exceptions import AuthenticationError

    server = EmbeddedRedis(tmp_path / "redis").start()
    redis = connect(server.url)
    try:
        await redis.set("k", "before")
        server.kill()

        async def restart_later() -> None:
            await asyncio.sleep(1.5)
            await asyncio.to_thread(server.start)  # same directory, port and password

        restarting = asyncio.create_task(restart_later())
        t0 = time.monotonic()
        assert await redis.get("k") == b"before"  # issued while Redis is down: waits for it, then answers
        assert 1.0 < time.monotonic() - t0 < 20
        await restarting

        wrong = connect(server.url.replace(server.password, "not-the-password"))
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError):
            await wrong.ping()
        assert time.monotonic() - t0 < 2
        await wrong.aclose()
    finally:
        await redis.aclose()
        server.stop()
