"""Every process a test session starts dies with it, even when pytest itself is killed with SIGKILL.

A pytest of its own (its own session, this repository's fixtures) runs a test that starts what the
suite starts: the embedded Redis, both reward servers (``tandem serve reward``) with their gVisor and
bubblewrap sandboxes, and a learner-like tree (``torchrun`` whose two ranks move to sessions of their
own), then waits. Once they are up, that pytest is SIGKILLed: no finaliser runs. Within a minute no
process of its tree may be left (by pid and start time, read from /proc: runsc's gofer and sandbox
carry no environment of ours) nor any process carrying its owner tag (``host.processes.owned_by``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from host.processes import OWNER_VARIABLE, die_with_parent, kill_owned, owned_by

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent('''
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from host.processes import free_port

    RANK = "import time; time.sleep(600)"


    def test_start_what_the_suite_starts_then_wait(redis_server, reward_servers, tmp_path):
        rank = tmp_path / "rank.py"
        rank.write_text(RANK)
        torchrun = subprocess.Popen(
            [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "--master_port",
             str(free_port()), str(rank)], env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
        deadline = time.monotonic() + 120
        while len(_children(torchrun.pid)) < 2:  # both ranks started
            assert torchrun.poll() is None and time.monotonic() < deadline, torchrun.returncode
            time.sleep(0.2)
        ready = {"redis": redis_server.proc.pid, "reward": {b: s.pid for b, s in reward_servers.items()},
                 "torchrun": torchrun.pid, "ranks": _children(torchrun.pid)}
        Path(os.environ["SESSION_CHILD_READY"]).write_text(json.dumps(ready))
        time.sleep(600)  # killed long before


    def _children(pid):
        out = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
        return out
''')


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid``, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _tree(root: int) -> dict[int, int]:
    """pid -> start time of ``root``'s live descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
    out, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if (st := _stat(pid)) is not None and st[1] != "Z":
                out[pid] = st[2]
                todo.append(pid)
    return out


def _alive(tree: dict[int, int]) -> dict[int, str]:
    """Those of ``tree`` still running (same pid, same start time), with their command lines."""
    left = {}
    for pid, started in tree.items():
        st = _stat(pid)
        if st is not None and st[1] != "Z" and st[2] == started:
            try:
                left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            except (FileNotFoundError, ProcessLookupError):
                continue
    return left


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow  # over 9 s: make test, not make test-fast
def test_a_killed_session_leaves_no_process(tmp_path):
    (tmp_path / "test_child.py").write_text(CHILD)
    ready = tmp_path / "ready.json"
    parent = os.environ.get(OWNER_VARIABLE)
    tag = f"{parent}/session-cleanup-{uuid.uuid4().hex[:8]}" if parent else f"session-cleanup-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, OWNER_VARIABLE: tag, "SESSION_CHILD_READY": str(ready)}
    log = tmp_path / "child.log"
    with open(log, "wb") as out:
        session = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest",
             "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(tmp_path / "test_child.py")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,
        )
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert session.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        started = json.loads(ready.read_text())
        tree = _tree(session.pid)
        commands = _alive(tree)
        # what is to die: Redis, both reward servers and gVisor's sandboxes (runsc, its gofer and
        # sandbox; bubblewrap starts one per job), torchrun and its ranks (sessions of their own)
        assert started["redis"] in tree and set(started["reward"].values()) <= tree.keys(), (started, commands)
        assert {started["torchrun"], *started["ranks"]} <= tree.keys() and len(started["ranks"]) == 2
        assert any("runsc-sandbox" in c for c in commands.values()), commands

        os.kill(session.pid, signal.SIGKILL)
        session.wait()
        t0 = time.monotonic()
        while (_alive(tree) or owned_by(tag)) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        left = {**_alive(tree), **{pid: "(tagged)" for pid in owned_by(tag)}}
        assert not left, f"left {time.monotonic() - t0:.0f} s after pytest was killed: {left}"
        print(f"{len(tree)} processes gone {time.monotonic() - t0:.1f} s after pytest was killed")
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
        for pid in _alive(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_owned(tag)
