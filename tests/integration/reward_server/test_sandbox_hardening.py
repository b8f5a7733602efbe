"""Sandbox hardening, against real gVisor and bubblewrap sandboxes (issue 12, item 2).

Each case is something a completion did to the shipped server: flood the
agent's results pipe, leave System V shared memory for the next job, make a
user namespace with full capabilities, signal the agent, take more memory
than its limits with many processes, or ask for limits the server should
never grant. Every case runs under both backends where it applies; the
``--warm`` mode of Modal's pooled sandboxes runs offline in a gVisor
container, with ``runsc exec`` standing in for ``sandbox.exec``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from reward_server.sandbox.base import Job, Run, python_run
from reward_server.sandbox.modal import exec_args, outcome_of_exec
from services.reward_specs import Limits

BACKENDS = ("gvisor", "bwrap")
LIMITS = Limits(wall_s=4, cpu_s=4)
HOG_MB, HOG_KIDS = 150, 6  # six processes of 150 MB each: each under its own 256 MB, together far over


@pytest.fixture(scope="module")
async def one_gvisor():
    """One warm gVisor sandbox (so consecutive jobs share it), sized for jobs of at most 256 MB."""
    from reward_server.sandbox.gvisor import GVisorSandbox

    sandbox = GVisorSandbox(workers=1, max_memory_mb=256, tmp_mb=64)
    await sandbox.start()
    yield sandbox
    await sandbox.close()


@pytest.fixture(scope="module")
async def one_bwrap():
    from reward_server.sandbox.bwrap import BwrapSandbox

    sandbox = BwrapSandbox(workers=1)
    yield sandbox
    await sandbox.close()


@pytest.fixture(params=BACKENDS)
def box(request, one_gvisor, one_bwrap):
    return {"gvisor": one_gvisor, "bwrap": one_bwrap}[request.param]


async def run_code(sandbox, code: str, limits: Limits = LIMITS):
    (outcome,) = await sandbox.run(Job(files={"main.py": code}, runs=[python_run(sandbox.python)], limits=limits))
    return outcome


async def still_fine(sandbox) -> None:
    out = await run_code(sandbox, "print(6 * 7)")
    assert (out.status, out.stdout) == ("ok", "42\n"), out


def results_run(python: str, code: str) -> Run:
    """A run that gets a results pipe (``sys.argv[1]`` is its descriptor) without the harness."""
    return Run(argv=[python, "-c", code, "{results_fd}"], results=True)


async def test_results_pipe_flood_is_capped(box):
    flood = "import os, sys\nfd = int(sys.argv[1])\nline = b'{\"i\": 0, \"ok\": true}\\n' * 4096\nwhile True:\n    os.write(fd, line)\n"
    started = time.monotonic()
    (out,) = await box.run(Job(files={}, runs=[results_run(box.python, flood)],
                               limits=Limits(wall_s=3, cpu_s=3, output_bytes=1 << 20)))
    assert out.status == "output_limit", out
    assert len(json.dumps(out.results)) <= 2 << 20  # about the cap, not what the program sent
    assert time.monotonic() - started < 3  # killed at the cap, not at the wall limit
    await still_fine(box)


async def test_garbage_on_the_results_pipe_is_not_a_sandbox_error(box):
    code = "import os, sys\nos.write(int(sys.argv[1]), b'{not json\\n' + b'[' * 100000 + b'\\n{\"i\": 0}\\n')\n"
    (out,) = await box.run(Job(files={}, runs=[results_run(box.python, code)], limits=LIMITS))
    assert out.status == "ok", out
    assert out.results == [{"i": 0}]


SHM_WRITE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
segment = libc.shmget(0x7A11, 4096, 0o1666)
ctypes.memmove(libc.shmat(segment, None, 0), b"left-by-job-one", 15)
print(segment)
"""
SHM_READ = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
segment = libc.shmget(0x7A11, 4096, 0)
print(ctypes.string_at(libc.shmat(segment, None, 0), 15).decode() if segment >= 0 else "none")
"""


async def test_shared_memory_of_one_job_is_gone_for_the_next(box):
    first = await run_code(box, SHM_WRITE)
    assert first.status == "ok" and int(first.stdout) >= 0, first
    second = await run_code(box, SHM_READ)
    assert (second.status, second.stdout) == ("ok", "none\n"), second


KILL_THE_AGENT = """
import os, signal
hit = []
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGPIPE,
            signal.SIGALRM, signal.SIGKILL):
    for pid in {1, os.getppid()}:
        try:
            os.kill(pid, sig)
            hit.append(sig)
        except OSError:
            pass
import time
time.sleep(0.3)
print("alive")
"""


async def test_a_program_cannot_kill_its_agent(box):
    out = await run_code(box, KILL_THE_AGENT)
    assert (out.status, out.stdout) == ("ok", "alive\n"), out
    await still_fine(box)


NAMESPACES_AND_FRIENDS = """
import ctypes, errno, json, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    r = libc.syscall(*args)
    if r == 0 and args[0] == 56:
        os._exit(0)  # the child of a clone that was allowed
    return "allowed" if r >= 0 else errno.errorcode[ctypes.get_errno()]
got = {
    "unshare_user": call(272, 0x10000000),
    "unshare_net": call(272, 0x40000000),
    "clone_newuser": call(56, 0x10000000 | 17, 0, 0, 0, 0),  # CLONE_NEWUSER | SIGCHLD
    "ptrace_traceme": call(101, 0, 0, 0, 0),
    "keyctl": call(250, 0, 0, 0, 0, 0),
    "bpf": call(321, 0, 0, 0),
    "mount": call(165, 0, 0, 0, 0, 0),
}
t = threading.Thread(target=lambda: None)
t.start()
t.join()
got["thread"] = "allowed"
got["subprocess"] = subprocess.run([sys.executable, "-c", "pass"]).returncode
print(json.dumps(got))
"""


async def test_bwrap_refuses_namespaces_ptrace_keyctl_bpf_mount(one_bwrap):
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86-64 syscall numbers")
    out = await run_code(one_bwrap, NAMESPACES_AND_FRIENDS)
    assert out.status == "ok", out
    got = json.loads(out.stdout)
    assert {k: v for k, v in got.items() if k not in ("thread", "subprocess")} == {
        "unshare_user": "EPERM", "unshare_net": "EPERM", "clone_newuser": "EPERM", "ptrace_traceme": "EPERM",
        "keyctl": "EPERM", "bpf": "EPERM", "mount": "EPERM"}, got
    assert got["thread"] == "allowed" and got["subprocess"] == 0  # threads and fork+exec still work


MEMORY_HOG = f"""
import os, sys
done = 0
kids = []
for _ in range({HOG_KIDS}):
    pid = os.fork()
    if pid == 0:
        block = bytearray({HOG_MB} << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        import time
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    _, status = os.waitpid(pid, 0)
    done += os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
print(done)
"""


async def test_many_processes_cannot_take_more_memory_together(box):
    out = await run_code(box, MEMORY_HOG, Limits(wall_s=10, cpu_s=10, memory_mb=256))
    # gVisor: the sandbox's cgroup runs out and the job gets memory_limit; bubblewrap: the job's
    # cgroup OOM-kills the hogs (the agent survives). Without cgroups all six would finish.
    assert out.status == "memory_limit" or (out.status == "ok" and int(out.stdout) < HOG_KIDS), out
    await still_fine(box)


async def test_every_gvisor_job_gets_its_own_uid(one_gvisor):
    outs = [await run_code(one_gvisor, "import os\nprint(os.getuid())") for _ in range(3)]
    assert all(o.status == "ok" for o in outs), outs
    assert len({o.stdout for o in outs}) == 3, [o.stdout for o in outs]


async def test_every_bwrap_job_runs_under_its_own_host_uid(one_bwrap):
    """Inside, every job is uid 65534 of its own user namespace; on the host, each has its own uid."""
    if not one_bwrap.cgroups:
        pytest.skip("finds the job's host processes through its cgroup")
    seen: dict[str, set[int]] = {}

    async def watch() -> None:
        while True:
            for d in Path("/sys/fs/cgroup/pids").glob(f"tandem-bwrap-{os.getpid()}-*"):
                try:
                    pids = (d / "cgroup.procs").read_text().split()
                    seen.setdefault(d.name, set()).update(os.stat(f"/proc/{p}").st_uid for p in pids)
                except OSError:
                    continue  # gone while we looked
            await asyncio.sleep(0.01)

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        outs = [await run_code(one_bwrap, "import time\ntime.sleep(0.3)") for _ in range(3)]
    finally:
        watcher.cancel()
    assert all(o.status == "ok" for o in outs), outs
    uids = [u for u in seen.values() if u]
    assert len(uids) == 3 and all(len(u) == 1 for u in uids), seen
    assert len(set.union(*uids)) == 3, seen


def kill_cgroups_as_they_appear(prefix: str, count: int) -> asyncio.Task:
    """Kill everything in each of the first ``count`` new cgroups named ``prefix*`` once its program runs
    (bwrap, the agent and the program: three processes): a sandbox that ends mid-job, from the host's side."""
    root = Path("/sys/fs/cgroup/pids")

    async def hunt() -> None:
        killed: set[str] = set()
        while len(killed) < count:
            for d in root.glob(f"{prefix}*"):
                if d.name in killed:
                    continue
                try:
                    pids = (d / "cgroup.procs").read_text().split()
                except OSError:
                    continue  # removed while we looked
                if len(pids) >= 3:
                    await asyncio.sleep(0.2)
                    for pid in (d / "cgroup.procs").read_text().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    killed.add(d.name)
            await asyncio.sleep(0.01)

    return asyncio.get_running_loop().create_task(hunt())


@pytest.mark.parametrize("ends", [1, 2])
async def test_a_sandbox_that_ends_mid_job_is_retried_then_blamed_on_the_job(one_bwrap, ends):
    if not one_bwrap.cgroups:
        pytest.skip("needs per-job cgroups to find the job's processes")
    hunter = kill_cgroups_as_they_appear(f"tandem-bwrap-{os.getpid()}-", ends)
    try:
        out = await run_code(one_bwrap, "import time\ntime.sleep(1)\nprint('done')\n")
    finally:
        hunter.cancel()
    if ends == 1:  # one end is the host's hiccup: the retry's answer stands
        assert (out.status, out.stdout) == ("ok", "done\n"), out
    else:  # two ends, and a canary job is answered: the job ends sandboxes
        assert out.status == "runtime_error" and "ended its sandbox" in out.detail, out
    await still_fine(one_bwrap)


async def test_modal_warm_mode_cleans_a_reused_container_between_jobs(tmp_path):
    """Modal's code path offline: jobs exec'd one after another into one long-lived gVisor container."""
    from reward_server.sandbox.gvisor import make_bundle

    bundle, python = make_bundle(tmp_path / "bundle", tmp_mb=64)
    config = json.loads((bundle / "config.json").read_text())
    config["process"]["args"] = [python, "-c", "import time; time.sleep(600)"]
    (bundle / "config.json").write_text(json.dumps(config))
    state = Path(tempfile.mkdtemp(prefix="tandem-warm-"))
    cid = f"tandem-warm-{os.getpid()}"
    runsc = ["runsc", "--root", str(state)]
    container = subprocess.Popen([*runsc, "--network=none", "run", "--bundle", str(bundle), cid],
                                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def exec_(argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess:
        return subprocess.run([*runsc, "exec", cid, *argv], input=stdin, capture_output=True, timeout=60, check=False)

    try:
        for _ in range(200):
            if subprocess.run([*runsc, "state", cid], capture_output=True, check=False).returncode == 0:
                break
            time.sleep(0.05)
        # A stock container: /tmp and /dev/shm writable by anyone, as in Modal's image.
        assert exec_([python, "-c", "import os; os.chmod('/tmp', 0o1777)"]).returncode == 0
        leave = ("import os, subprocess\nprint(os.getuid())\n"
                 "for p in ('/tmp/left', '/dev/shm/left', 'left'):\n"
                 "    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
                 "import sys\n"
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n")
        look = ("import os\nprint(os.getuid())\n"
                "print(sorted(p for p in ('/tmp/left', '/dev/shm/left') if os.path.exists(p)))\n"
                "live = [p for p in os.listdir('/proc') if p.isdigit()\n"
                "        and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z']\n"
                "print(sorted(os.stat(f'/proc/{p}').st_uid for p in live))\n")
        outs = []
        for code in (leave, look):
            job = Job(files={"main.py": code}, runs=[python_run(python)], limits=LIMITS)
            argv, _timeout = exec_args(job)
            done = exec_([python, *argv[1:]], job.frame())
            (out,) = outcome_of_exec(job, done.returncode, done.stdout, done.stderr.decode(errors="replace"))
            assert out.status == "ok", out
            outs.append(out.stdout.splitlines())
        first_uid, (second_uid, left, uids) = int(outs[0][0]), outs[1]
        assert first_uid != second_uid and first_uid >= 20000
        assert left == "[]"  # nothing the first job wrote outside its work dir
        assert str(first_uid) not in uids.strip("[]").split(", ")  # its background process is gone
    finally:
        subprocess.run([*runsc, "kill", cid, "KILL"], capture_output=True, check=False)
        try:
            container.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(container.pid, signal.SIGKILL)
            container.wait()
        subprocess.run([*runsc, "delete", "--force", cid], capture_output=True, check=False)
        subprocess.run(["rm", "-rf", str(state)], check=False)


async def test_limits_above_the_server_ceilings_are_refused(reward_app):
    async with reward_app(sandbox="bwrap", max_memory_mb=512, max_wall_s=10) as (_app, client):
        resp = await client.post("/v1/execute", json={"code": "print(1)", "limits": {"memory_mb": 4096}})
        assert resp.status_code == 422 and "limits.memory_mb" in resp.json()["detail"], resp.text
        spec = {"type": "python_tests", "tests": ["assert True"], "limits": {"wall_s": 60}}
        resp = await client.post("/v1/score", json={"items": [{"id": "a", "completion": "x = 1", "spec": spec}]})
        assert resp.status_code == 422 and "items.0.spec.limits.wall_s" in resp.json()["detail"], resp.text
        ok = await client.post("/v1/execute", json={"code": "print(1)", "limits": {"memory_mb": 512, "wall_s": 10}})
        assert ok.status_code == 200 and ok.json()["status"] == "ok", ok.text


async def test_the_queue_clamps_every_job_to_the_ceilings(reward_app):
    async with reward_app(sandbox="bwrap", max_memory_mb=300) as (app, _client):
        queue = app.state.scorer.queue
        code = "import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)"
        (out,) = await queue.run(Job(files={"main.py": code}, runs=[python_run(queue.sandbox.python)],
                                     limits=Limits(memory_mb=4096)))
        assert (out.status, out.stdout) == ("ok", "300\n"), out
