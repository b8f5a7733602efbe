"""math-verify in its process pool: equivalences, a comparison that never ends, a worker that dies, shutdown.

The pool's workers are found the way an operator would: this process's
children that run ``multiprocessing.spawn``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from pebble import CONSTS

from reward_server.verifiers.math import MathVerifier
from services.reward_specs import MathSpec

TOWER = "9^{9^{9^{9^{9}}}}"  # evaluating it does not finish


def spawned_children() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue  # the thread ended while we looked
    found = set()
    for pid in pids:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:
            continue
    return found


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_runaway_comparison_kills_its_worker_and_the_next_one_is_answered():
    before = spawned_children()
    verifier = MathVerifier(workers=1, timeout_s=3.0)
    try:
        assert await verifier.equivalent("\\frac{1}{2}", "0.5") == (True, "")
        assert (await verifier.equivalent("x^2 + 2x + 1", "(x+1)^2"))[0] is True
        assert (await verifier.equivalent("3", "4"))[0] is False
        (worker,) = spawned_children() - before

        started = time.monotonic()
        ok, detail = await asyncio.wait_for(verifier.equivalent("1", TOWER), 30)
        assert ok is None and "took over 3 s" in detail
        # the timeout, then at most pebble's SIGTERM grace before SIGKILL, plus its 0.1 s polling
        assert time.monotonic() - started < 3.0 + CONSTS.term_timeout + 2.0
        assert not Path(f"/proc/{worker}").exists(), "the runaway worker is still alive"

        result = await verifier.score("i", "<answer>\\frac{6}{4}</answer>", MathSpec(answer="1.5"))
        assert (result.reward, result.status) == (1.0, "ok")  # a replacement worker answers
        (replacement,) = spawned_children() - before
        assert replacement != worker
    finally:
        await verifier.close()
    assert spawned_children() - before == set(), "close() left math-verify workers running"


async def test_a_worker_that_dies_under_a_comparison_fails_only_that_item():
    before = spawned_children()
    verifier = MathVerifier(workers=1, timeout_s=120.0)
    try:
        assert (await verifier.equivalent("2", "2"))[0] is True
        (worker,) = spawned_children() - before
        idle = cpu_s(worker)
        pending = asyncio.create_task(verifier.score("dies", f"<answer>{TOWER}</answer>", MathSpec(answer="1")))
        while cpu_s(worker) - idle < 0.5:  # the worker is busy with the tower
            assert not pending.done()
            await asyncio.sleep(0.05)
        os.kill(worker, signal.SIGKILL)  # what the OOM killer would do
        result = await asyncio.wait_for(pending, 30)
        assert (result.reward, result.status) == (None, "sandbox_error")
        assert "worker died" in result.detail
        after = await verifier.score("next", "<answer>7</answer>", MathSpec(answer="7"))
        assert (after.reward, after.status) == (1.0, "ok")
    finally:
        await verifier.close()


async def test_the_app_ends_its_math_workers_on_shutdown(reward_app):
    before = spawned_children()
    async with reward_app(sandbox="none", math_workers=2) as (_app, client):
        scored = await client.post("/v1/score", json={"items": [
            {"id": "m", "completion": "<answer>0.5</answer>", "spec": {"type": "math", "answer": "\\frac{1}{2}"}}]})
        assert scored.json()["results"][0]["status"] == "ok"
        assert len(spawned_children() - before) == 2
    assert spawned_children() - before == set()
