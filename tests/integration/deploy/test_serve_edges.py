"""Start-up and shutdown edges of the real processes (issue 13, item 6).

- A port that cannot be listened on: ``tandem serve NAME`` exits 3 with one
  last line naming the port, at once when the port is taken before it
  starts, and within seconds of uvicorn's failed bind when the port is
  taken while the rollout server's vLLM engine starts (the engine core and
  its workers are ended, nothing of the process group is left).
- A full run directory (a small real tmpfs): the learner's publish fails
  with the free space and the size it needs, leaves no version directory
  nor temp files, registers nothing; earlier versions keep their checksum;
  a checkpoint that does not fit leaves the previous checkpoint in force.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from host.processes import free_port, stop_group
from learner.retention import RETENTION_FILE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
NAMES = {"control": "tandem control plane", "reward": "reward", "rollout": "rollout", "learner": "learner"}


def hold_port(port: int) -> socket.socket:
    """A listener on 127.0.0.1:``port`` that another program holds."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def serve(name: str, port: int, run_dir: Path, log: Path, model: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    env.update(TANDEM_RUN_DIR=str(run_dir), TANDEM_ROLLOUT_KV_CACHE_GIB="0.25", OMP_NUM_THREADS="1")
    args = ["--model", str(model)] if model is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", name, "--port", str(port), *args],
        cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,  # noqa: SIM115
    )


class Family:
    """Every process seen under ``proc`` (sampled while it runs), to check that none outlives it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.seen: dict[int, set[str]] = {}
        """pid -> every name it had (vLLM renames its processes after the fork)."""

    def sample(self) -> None:
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, set()).add(child.name())
        except psutil.NoSuchProcess:
            pass

    def named(self, part: str) -> bool:
        return any(part in name for names in self.seen.values() for name in names)

    def left(self, grace_s: float = 10.0) -> list[str]:
        """Processes seen, or of the process group, still alive ``grace_s`` after the process exited
        (zombies aside: the kernel keeps those until init reaps them)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = []
            for p in psutil.process_iter(["name", "status"]):
                try:
                    mine = p.pid in self.seen or os.getpgid(p.pid) == self.proc.pid
                except ProcessLookupError:
                    continue
                if mine and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.info['name']} {' '.join(p.cmdline())[:200]}")
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)


def last_line(log: Path) -> str:
    """The process's last line. Python's multiprocessing resource tracker, a process of its own that
    vLLM's forked engine core shares, may write after it: when the engine core was ended before it
    released its shared memory, the tracker says so (two lines) and unlinks it."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    while lines and ("resource_tracker" in lines[-1] or "warnings.warn(" in lines[-1]):
        lines.pop()
    return lines[-1] if lines else ""


def test_port_problem_is_what_uvicorn_would_meet():
    from services.serving import port_problem

    port = free_port()
    assert port_problem("127.0.0.1", port) is None
    with hold_port(port):
        assert port_problem("127.0.0.1", port) == f"cannot listen on 127.0.0.1:{port}: address already in use"
        assert port_problem("0.0.0.0", port) == f"cannot listen on 0.0.0.0:{port}: address already in use"
    assert port_problem("127.0.0.1", port) is None  # released (and its TIME_WAIT does not count)
    assert port_problem("no-such-host.invalid", port).startswith(f"cannot listen on no-such-host.invalid:{port}: ")


@pytest.mark.parametrize("name", ["control", "reward", "learner", "rollout"])
def test_a_port_taken_before_start_stops_the_service_at_once(name, tiny_model, tmp_path):
    port = free_port()
    holder = hold_port(port)
    log = tmp_path / f"{name}.log"
    proc = serve(name, port, tmp_path / "runs", log, tiny_model if name == "rollout" else None)
    family = Family(proc)
    try:
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 60:
            family.sample()
            time.sleep(0.1)
        rc, took = proc.wait(timeout=5), time.monotonic() - t0
        left = family.left()
    finally:
        stop_group(proc)
        holder.close()
    said = log.read_text(errors="replace")
    assert rc == 3, said[-3000:]
    assert last_line(log) == f"{NAMES[name]}: cannot listen on 127.0.0.1:{port}: address already in use", said[-3000:]
    assert "Application startup" not in said, "the lifespan started before the port was checked"
    assert not family.named("EngineCore")
    assert took < 60, f"took {took:.1f}s to refuse a taken port"  # imports only (torch, vllm), on a busy machine
    assert left == []


@pytest.mark.long
def test_a_port_taken_while_the_engine_starts_ends_the_engine_and_exits_promptly(tiny_model, tmp_path):
    port = free_port()
    log = tmp_path / "rollout.log"
    proc = serve("rollout", port, tmp_path / "runs", log, tiny_model)
    family = Family(proc)
    holder = None
    bind_failed_at = None
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            family.sample()
            if holder is None and family.named("EngineCore"):
                holder = hold_port(port)  # the engine is starting: uvicorn binds only once it is up
            if bind_failed_at is None and "error while attempting to bind" in log.read_text(errors="replace"):
                bind_failed_at = time.monotonic()
            time.sleep(0.1)
        exited_at = time.monotonic()
        rc = proc.wait(timeout=5)
        left = family.left()
    finally:
        stop_group(proc)
        if holder is not None:
            holder.close()
    said = log.read_text(errors="replace")
    assert holder is not None, f"never saw the engine core start: {family.seen}\n{said[-3000:]}"
    assert rc == 3, said[-3000:]
    assert "vLLM engine for" in said and bind_failed_at is not None, said[-3000:]
    assert last_line(log) == (
        f"rollout: cannot listen on 127.0.0.1:{port}: address already in use "
        "(taken while the service started; it has stopped again)"
    ), said[-3000:]
    assert exited_at - bind_failed_at < 20, f"exited {exited_at - bind_failed_at:.1f}s after the failed bind"
    assert family.named("EngineCore")
    assert left == [], said[-3000:]


# -- a full run directory ---------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs as a run directory (unmounted at teardown), and a way to fill it up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Take the disk's free space but ``leave`` bytes, in one file (removed to make room again)."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    assert free > leave, (free, leave)
    filler = disk / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free - leave)
    return filler


def tree(path: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``path``."""
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


async def until(proc, predicate, timeout_s: float, what: str) -> dict:
    """The learner's status once ``predicate`` holds (a failed learner is a status like any other)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    st = None
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, f"learner exited waiting for {what}:\n{proc.tail()}"
        st = await asyncio.to_thread(proc.status)
        if st is not None and predicate(st):
            return st
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last status {st}\n{proc.tail()}")


async def feed(redis, keys, version: int, n: int, seed: int) -> None:
    from tests.fixtures.learner import add_group

    for i in range(n):
        await add_group(redis, keys, version, seed=seed + i)


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
async def test_a_version_that_does_not_fit_fails_the_run_and_keeps_the_previous(
    control_db_url, control_redis, tiny_model, tmp_path, small_disk, learner_proc
):
    """Stack mode (the learner follows the control plane's run registry): the run ends ``failed``
    with the reason."""
    import tomllib
    import uuid

    from broker import Keys, WeightRegistry
    from services import weightstore as store
    from services.runs import RunStore
    from tests.fixtures.learner import write_run_config

    cfg = write_run_config(tmp_path / "run.toml", tiny_model,
                           {"learner": {"steps": 4, "checkpoint_every": 0}, "publish": {"every": 1, "keep": 100}})
    proc = learner_proc(cfg, None, small_disk, url=control_db_url)
    runs = RunStore(control_redis)
    keys = Keys(f"full-{uuid.uuid4().hex[:8]}")
    await runs.create(keys.run_id, "ps-x", tomllib.loads(cfg.read_text()))
    weights = small_disk / keys.run_id / "weights"
    await feed(control_redis, keys, 0, 2, seed=0)
    await until(proc, lambda s: s["version"] == 1 and s["state"] == "waiting", 300, "version 1")
    registry = WeightRegistry(control_redis, keys)
    v1 = await registry.latest()
    assert v1.version == 1 and store.on_disk(weights) == [1]

    # about half a version's space left: version 2 cannot fit
    fill(small_disk, v1.bytes // 2)
    await feed(control_redis, keys, 1, 2, seed=10)
    st = await until(proc, lambda s: s["state"] == "failed", 300, "the failed publish of version 2")

    assert st["version"] == 1  # step 2 trained, its publish failed (the status reports a step after it)
    assert st["error"].startswith(f"RunDirectoryFull: run directory {weights} is full: "), st["error"]
    free, needed = (int(x) for x in re.findall(r"(\d+) bytes free, the version needs about (\d+)$", st["error"])[0])
    assert free < v1.bytes < needed
    record = await runs.get(keys.run_id)
    assert (record.state, record.error) == ("failed", st["error"])
    # nothing of version 2: no directory, no temp files, nothing registered
    assert sorted(p.name for p in weights.iterdir() if p.name != RETENTION_FILE) == ["v00000001"]
    assert [w.version for w in await registry.history()] == [1]
    assert (await registry.latest()).version == 1
    # version 1 is intact
    store.verify(v1.uri, v1.sha256)


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
async def test_a_checkpoint_that_does_not_fit_leaves_the_previous_in_force(
    redis, keys, tiny_model, tmp_path, small_disk, learner_proc
):
    from tests.fixtures.learner import write_run_config

    # no publishing within the run: only checkpoints are written (at steps 2 and 4)
    cfg = write_run_config(tmp_path / "run.toml", tiny_model,
                           {"learner": {"steps": 4, "checkpoint_every": 2}, "publish": {"every": 100}})
    proc = learner_proc(cfg, keys.run_id, small_disk)
    checkpoints = small_disk / keys.run_id / "checkpoints"
    await feed(redis, keys, 0, 4, seed=0)
    await until(proc, lambda s: s["step"] == 2 and s["state"] == "waiting", 300, "the checkpoint of step 2")
    pointer = checkpoints / "tandem-latest"
    assert pointer.read_text() == "step00000002"
    saved = tree(checkpoints / "step00000002")
    size = sum((checkpoints / "step00000002" / name).stat().st_size for name in saved)

    fill(small_disk, size // 4)  # room for the logs of steps 3 and 4, not for a checkpoint
    await feed(redis, keys, 0, 4, seed=10)
    st = await until(proc, lambda s: s["state"] == "failed", 300, "the failed checkpoint of step 4")

    assert st["step"] == 3, st  # step 4 trained, its checkpoint failed (reported after it)
    # torch reports the full disk as "[enforce fail at inline_container.cc:...] unexpected pos ...";
    # the learner names it, and the half-written step 4 is gone
    assert st["error"].startswith(f"RunDirectoryFull: run directory {checkpoints} is full: "), st["error"]
    assert "the checkpoint needs about" in st["error"] and not (checkpoints / "step00000004").exists()
    # the pointer still names step 2, whose files are as they were
    assert pointer.read_text() == "step00000002"
    assert tree(checkpoints / "step00000002") == saved
    proc.stop()

    # with room again, a new learner resumes from that checkpoint and trains steps 3 and 4 again
    # (their groups were never acknowledged: no checkpoint held them)
    (small_disk / "filler").unlink()
    again = learner_proc(cfg, keys.run_id, small_disk)
    st = await until(again, lambda s: s["state"] in ("done", "failed"), 300, "the resumed learner")
    assert (st["state"], st["resumed_from"], st["step"]) == ("done", 2, 4), st
    assert pointer.read_text() == "step00000004"
