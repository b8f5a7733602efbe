"""The sandbox layer directly: isolation between submissions, limits, reuse, recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from reward_server.sandbox.base import Job, Run, harness_run, python_run
from services.reward_specs import Limits

LIMITS = Limits(wall_s=3, cpu_s=3)


async def run_code(sandbox, code: str, limits: Limits = LIMITS, stdin: str = ""):
    (outcome,) = await sandbox.run(Job(files={"main.py": code}, runs=[python_run(sandbox.python, stdin=stdin)],
                                       limits=limits))
    return outcome


async def test_minimal_root_clean_env_non_root(sandbox):
    code = "import os, json\nprint(json.dumps([os.getuid() != 0, sorted(os.listdir('/')), sorted(os.environ)]))"
    out = await run_code(sandbox, code)
    assert out.status == "ok", out
    not_root, root, env = json.loads(out.stdout)
    assert not_root
    assert set(root) <= {"usr", "lib", "lib64", "opt", "tmp", "proc", "dev", "sys"}
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "PWD"}


async def test_submissions_cannot_see_each_other(sandbox):
    first = await run_code(sandbox, "import os\nopen('mine.txt', 'w').write('A')\nprint(os.getcwd(), os.getuid())")
    second = await run_code(sandbox, "import os, glob\nprint(os.getcwd(), os.getuid(), glob.glob('/tmp/**/mine.txt', recursive=True))")
    assert first.status == second.status == "ok"
    cwd1, uid1 = first.stdout.split()
    cwd2, uid2, found = second.stdout.split(maxsplit=2)
    assert cwd1 != cwd2 and found.strip() == "[]"
    if sandbox.name == "gvisor":
        assert uid1 != uid2  # a fresh uid per job in the shared sandbox


async def test_stdin_files_and_several_runs(sandbox):
    job = Job(
        files={"solution.py": "import sys\nprint(sum(map(int, sys.stdin.read().split())))"},
        runs=[python_run(sandbox.python, "solution.py", "1 2 3"),
              harness_run(sandbox.python, ["assert 1 + 1 == 2", "assert False", "assert undefined_name"],
                          LIMITS.wall_s),
              Run(argv=[sandbox.python, "-I", "-c", "import sys; sys.exit(4)"])],
        limits=LIMITS,
    )
    summed, tests, exits = await sandbox.run(job)
    assert summed.stdout == "6\n"
    assert [r["ok"] for r in tests.results] == [True, False, False]
    assert tests.results[2]["error"].startswith("NameError")
    assert exits.status == "runtime_error" and exits.exit_code == 4


async def test_cpu_limit_below_wall_limit(sandbox):
    out = await run_code(sandbox, "while True:\n    pass\n", Limits(wall_s=20, cpu_s=1))
    assert out.status == "timeout" and "cpu" in out.detail
    assert out.wall_s < 10


async def test_process_limit(sandbox):
    code = """
import os, time
n = 0
try:
    for _ in range(100):
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
"""
    out = await run_code(sandbox, code, Limits(wall_s=5, cpu_s=5, processes=8))
    assert out.status == "ok", out
    # Linux refuses the fork that would make 9 processes of the uid (n == 7); gVisor's
    # RLIMIT_NPROC check lets one more through (n == 8). Either way far below 100.
    assert int(out.stdout) <= 8


async def test_parallel_jobs_get_right_answers(sandbox):
    outs = await asyncio.gather(*(run_code(sandbox, f"print({i} * {i})") for i in range(8)))
    assert [o.stdout for o in outs] == [f"{i * i}\n" for i in range(8)]


async def test_gvisor_sandboxes_are_recycled():
    from reward_server.sandbox.gvisor import GVisorSandbox

    sandbox = GVisorSandbox(workers=1, max_jobs=3)
    try:
        await sandbox.start()
        for i in range(7):
            assert (await run_code(sandbox, f"print({i})")).stdout == f"{i}\n"
        assert sandbox.pool.spawned == 3  # the first, then a fresh one after every 3 jobs
        assert sandbox.pool.live == 1
    finally:
        await sandbox.close()


@pytest.mark.long
@pytest.mark.slow
async def test_gvisor_unresponsive_sandbox_is_replaced(tmp_path):
    from reward_server.sandbox.gvisor import GVisorSandbox

    sandbox = GVisorSandbox(workers=1)
    try:
        await sandbox.start()
        (container,) = [sandbox.pool._idle.get_nowait()]  # noqa: SLF001 - stop its agent from outside
        sandbox.pool._idle.put_nowait(container)
        for _ in range(100):  # the container is registered a moment after `runsc run` starts
            state = subprocess.run([sandbox.runsc, "--root", str(container.state), "state", container.id],
                                   capture_output=True, text=True, check=False)
            if state.returncode == 0:
                break
            await asyncio.sleep(0.1)
        state = state.stdout
        os.kill(json.loads(state)["pid"], signal.SIGSTOP)  # a wedged sandbox: its kernel stops answering
        job = Job(files={"main.py": "print(1)"}, runs=[python_run(sandbox.python)], limits=Limits(wall_s=1, cpu_s=1))
        (outcome,) = await sandbox.run(job)
        assert outcome.status == "timeout" and "unresponsive" in outcome.detail
        assert (await run_code(sandbox, "print('back')")).stdout == "back\n"
    finally:
        await sandbox.close()
