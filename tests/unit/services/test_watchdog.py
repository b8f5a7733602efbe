"""services.watchdog: bounded waits raise, record and log; an uninterruptible thread ends its process.

Real hangs, no mocks: an event nobody sets, a FIFO nobody writes (a blocking
``open`` in a thread), a subprocess whose main thread blocks on such a FIFO.
Incidents go to the session's real Redis.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from services import watchdog
from services.config import ConfigError, parse_run_config
from services.watchdog import EXIT_STALLED, IncidentLog, Stalled

REPO = Path(__file__).resolve().parents[3]


def _read_fifo(path: Path) -> bytes:
    with open(path, "rb") as f:  # blocks until a writer opens the FIFO
        return f.read()


def _release(path: Path) -> None:
    """Open the FIFO for writing once, so a reader blocked on it returns (EOF)."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)


async def test_bounded_returns_in_time():
    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert await watchdog.bounded(quick(), what="x", on="y", limit_s=5, field="watchdog.x", action="a") == 7


async def test_a_wait_past_its_bound_raises_logs_and_records(redis, keys, caplog):
    never = asyncio.Event()
    log = IncidentLog(redis, keys, source="test:unit")
    t0 = time.monotonic()
    with pytest.raises(Stalled) as err:
        await watchdog.bounded(never.wait(), what="the unit test", on="an event nobody sets", limit_s=0.5,
                               field="watchdog.reload_s", action="refused; retried later", sink=log)
    waited = time.monotonic() - t0
    assert 0.5 <= waited < 3
    msg = str(err.value)
    # the seconds waited are the measured wait: 0.5 s on a quiet machine, more on a loaded one
    assert re.match(r"the unit test has waited (\d+\.\d) s on an event nobody sets \(limit 0\.5 s, config "
                    r"watchdog\.reload_s\)", msg), msg
    assert 0.5 <= float(re.match(r"the unit test has waited ([\d.]+)", msg)[1]) < 3
    assert msg.endswith("refused; retried later")
    assert err.value.status == 503 and err.value.retry_after
    assert any("has waited" in r.getMessage() and "Event.wait" in r.getMessage() for r in caplog.records)
    (inc,) = await log.recent(5)
    assert (inc.what, inc.field, inc.limit_s, inc.source) == ("the unit test", "watchdog.reload_s", 0.5, "test:unit")
    assert "wait" in inc.stack


async def test_a_thread_blocked_on_a_fifo_is_abandoned_with_its_stack(tmp_path, redis, keys):
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    log = IncidentLog(redis, keys)
    t0 = time.monotonic()
    try:
        with pytest.raises(Stalled) as err:
            await watchdog.bounded(
                watchdog.in_thread(_read_fifo, fifo, name="tandem-test-reader"), what="reading", on=str(fifo),
                limit_s=0.5, field="watchdog.reload_s", action="refused", sink=log, thread_prefix="tandem-test-reader",
            )
        assert time.monotonic() - t0 < 3
        assert "_read_fifo" in err.value.incident.stack  # the stuck thread's own frames
        assert [i.what for i in await log.recent()] == ["reading"]
        assert any(t.name == "tandem-test-reader" for t in threading.enumerate())  # abandoned, not joined
    finally:
        _release(fifo)
    for _ in range(50):
        if not any(t.name == "tandem-test-reader" for t in threading.enumerate()):
            break
        await asyncio.sleep(0.1)
    assert not any(t.name == "tandem-test-reader" for t in threading.enumerate())


async def test_incidents_come_back_newest_first_and_capped(redis, keys):
    log = IncidentLog(redis, keys)
    for i in range(3):
        await log.append(watchdog.incident(f"w{i}", "o", waited_s=1, limit_s=1, field="f", action="a"))
    assert [i.what for i in await log.recent(2)] == ["w2", "w1"]


def test_an_uninterruptible_thread_ends_the_process(tmp_path, redis_url):
    """A main thread blocked for good: the Watchdog logs its stack, records the incident, exits EXIT_STALLED."""
    fifo = tmp_path / "hang"
    os.mkfifo(fifo)
    run_id = f"wd-{os.getpid()}-{time.monotonic_ns()}"
    script = textwrap.dedent(f"""
        import logging
        from broker import Keys
        from services.watchdog import SyncIncidentLog, Watchdog
        logging.basicConfig(level=logging.INFO)
        dog = Watchdog(sink=SyncIncidentLog({redis_url!r}, Keys({run_id!r}), source="learner:rank0"))

        def deepspeed_step():
            with open({str(fifo)!r}, "rb") as f:
                f.read()

        with dog.guard("learner rank 0 of 1: optimizer step 3", "DeepSpeed", limit_s=1.0, field="watchdog.step_s"):
            deepspeed_step()
        print("not reached")
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == EXIT_STALLED, proc.stderr
    assert "not reached" not in proc.stdout
    assert ("learner rank 0 of 1: optimizer step 3 has waited 1." in proc.stderr
            and "(limit 1 s, config watchdog.step_s); the process exits for a restart" in proc.stderr), proc.stderr
    assert "in deepspeed_step" in proc.stderr  # the stuck thread's stack
    import redis

    from broker import Keys

    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(Keys(run_id).incidents)
    finally:
        client.close()
    assert len(entries) == 1 and b"watchdog.step_s" in entries[0][1][b"incident"]
    assert took < 30


def test_a_thread_stuck_holding_the_gil_is_ended_by_the_backstop():
    """C code that blocks with the GIL held (ctypes.PyDLL keeps it) stops the Python monitor too:
    faulthandler's C thread dumps the stacks and exits 1, ``backstop_s`` after the deadline."""
    script = textwrap.dedent("""
        import ctypes
        from services.watchdog import Watchdog
        dog = Watchdog(backstop_s=1.0)

        def stuck_in_c():
            ctypes.PyDLL(None).sleep(60)  # libc sleep(3), the GIL held throughout

        with dog.guard("learner rank 1 of 2: checkpoint save", "a hung filesystem", limit_s=1.0, field="watchdog.step_s"):
            stuck_in_c()
        print("not reached")
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr
    assert "Timeout (0:00:0" in proc.stderr and "in stuck_in_c" in proc.stderr, proc.stderr
    assert "not reached" not in proc.stdout
    assert took < 20


def test_watchdog_bounds_are_checked_against_each_other():
    base = {"model": {"path": "m"}, "data": {"train": "t"}}
    with pytest.raises(ConfigError, match="watchdog.collective_s .* must be above learner.wait_timeout_s"):
        parse_run_config({**base, "learner": {"wait_timeout_s": 60}, "watchdog": {"collective_s": 30}})
    with pytest.raises(ConfigError, match="must be at most watchdog.step_s"):
        parse_run_config({**base, "watchdog": {"collective_s": 1000, "step_s": 900}})
    with pytest.raises(ConfigError, match="watchdog.reload_s: Input should be greater than 0"):
        parse_run_config({**base, "watchdog": {"reload_s": 0}})
    cfg = parse_run_config({**base, "learner": {"wait_timeout_s": 5}, "watchdog": {"collective_s": 6, "step_s": 7}})
    assert (cfg.watchdog.collective_s, cfg.watchdog.step_s) == (6, 7)
