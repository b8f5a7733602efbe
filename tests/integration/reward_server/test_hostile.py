"""Hostile programs against the real reward server, under gVisor and under bubblewrap.

Every test sends one hostile program to ``POST /v1/execute`` of a server
started with ``tandem serve reward``, checks that it was contained (the
right verdict, nothing leaked, nothing outside the sandbox changed) and
then that the server is still healthy and judges the next, ordinary program
correctly.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from tests.fixtures.reward import REPO

FAST = {"wall_s": 2.0, "cpu_s": 2.0, "memory_mb": 256, "processes": 32, "output_bytes": 1 << 20}


async def execute(server, code: str, limits: dict | None = None, stdin: str = "") -> dict:
    async with server.client() as client:
        resp = await client.post("/v1/execute", json={"code": code, "stdin": stdin, "limits": limits or FAST})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def still_fine(server) -> None:
    """The server is healthy and the next ordinary program gets the right verdict."""
    async with server.client() as client:
        assert (await client.get("/healthz")).status_code == 200
    result = await execute(server, "print(sum(range(10)))")
    assert result["status"] == "ok", result
    assert result["stdout"] == "45\n"


async def test_fork_bomb(reward_server):
    code = "import os\nwhile True:\n    os.fork()\n"
    started = time.monotonic()
    result = await execute(reward_server, code)
    # fork() fails with EAGAIN (process limit) or ENOMEM (address space): either is contained.
    assert result["status"] in ("runtime_error", "timeout", "memory_limit"), result
    assert time.monotonic() - started < 15
    await still_fine(reward_server)


async def test_memory_bomb(reward_server):
    result = await execute(reward_server, "x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n")
    assert result["status"] == "memory_limit", result
    await still_fine(reward_server)


async def test_infinite_loop(reward_server):
    started = time.monotonic()
    result = await execute(reward_server, "while True:\n    pass\n")
    assert result["status"] == "timeout", result
    assert time.monotonic() - started < 10
    await still_fine(reward_server)


async def test_sleep_past_the_limit(reward_server):
    result = await execute(reward_server, "import time\ntime.sleep(60)\nprint('woke')\n")
    assert result["status"] == "timeout", result
    assert "woke" not in result["stdout"]
    assert result["wall_s"] < 60 / 4  # ended near its 2 s limit, not when the program's sleep ran out
    await still_fine(reward_server)


async def test_100mb_of_stdout(reward_server):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n"
    result = await execute(reward_server, code)
    assert result["status"] == "output_limit", result
    assert result["truncated"] is True
    assert len(result["stdout"]) + len(result["stderr"]) <= FAST["output_bytes"]
    await still_fine(reward_server)


async def test_huge_file(reward_server):
    code = "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))\n"
    result = await execute(reward_server, code, {**FAST, "file_bytes": 8 << 20})
    assert result["status"] == "output_limit", result
    assert "file" in result["stderr"].lower() or "large" in result["stderr"].lower()
    await still_fine(reward_server)


def host_address() -> str:
    """A non-loopback IPv4 address of this machine: the one its default route leaves from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # no packet is sent: this only picks a source address
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


@pytest.mark.parametrize("where", ["loopback", "host"])
async def test_network_is_unreachable(reward_server, where):
    # A listener the host itself can reach, so a refusal proves the sandbox and not the address.
    address = "127.0.0.1" if where == "loopback" else host_address()
    if where == "host" and address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    with socket.create_server((address, 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection((address, port), timeout=5):
            pass  # the host gets through
        code = (
            "import socket\n"
            "s = socket.socket()\n"
            "s.settimeout(1.0)\n"
            "try:\n"
            f"    s.connect(({address!r}, {port}))\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('refused', type(e).__name__)\n"
        )
        result = await execute(reward_server, code)
    assert result["status"] == "ok", result
    assert "CONNECTED" not in result["stdout"]
    assert result["stdout"].startswith("refused")
    await still_fine(reward_server)


async def test_secrets_stay_out(reward_server, reward_secret):
    own_source = REPO / "reward_server" / "app.py"
    code = f"""
import os
found = []
for path in ["/etc/shadow", {str(reward_secret.path)!r}, {str(own_source)!r}, "/proc/1/environ"]:
    try:
        with open(path, "rb") as f:
            found.append((path, f.read(4096)))
    except OSError as e:
        print("denied", path, type(e).__name__)
print("ENV", sorted(os.environ))
print("FOUND", found)
"""
    result = await execute(reward_server, code)
    assert result["status"] == "ok", result
    out = result["stdout"] + result["stderr"]
    assert reward_secret.value not in out
    assert reward_secret.env_name not in out
    assert "reward-test-token" not in out and "TANDEM_TOKEN" not in out
    assert "def build_app" not in out  # the server's own source
    assert "root:" not in out  # /etc/shadow
    for path in ("/etc/shadow", str(reward_secret.path), str(own_source)):
        assert f"denied {path}" in out
    await still_fine(reward_server)


def live_host_pids_with(marker: str) -> list[int]:
    """Live host processes whose command line holds ``marker`` (bubblewrap's jobs are host
    processes in a PID namespace of their own, invisible to the next job but not to the host)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # it ended while we looked
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


async def test_background_process_does_not_outlive_the_run(one_worker_reward_server):
    # One worker: under gVisor the probe runs in the very sandbox the first job ran in; under
    # bubblewrap every job has its own PID namespace, so the host looks for the leftover too.
    server = one_worker_reward_server
    head, tail = "leftover-", uuid.uuid4().hex  # the whole marker is only in the background child's argv
    code = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import time\\nprint('up', flush=True)\\nfor _ in range(600):\\n    time.sleep(0.1)\\n", {head!r} + {tail!r}],
    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
print(child.stdout.readline().decode().strip())
"""
    result = await execute(server, code)
    assert result["status"] == "ok" and result["stdout"] == "up\n", result  # it was alive when the run ended
    assert live_host_pids_with(head + tail) == []
    probe = f"""
import os
others, marked = [], []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) > 2 and int(p) not in (os.getpid(), os.getppid()):
        others.append(int(p))
        try:
            marked += [p] if ({head!r} + {tail!r}).encode() in open(f'/proc/{{p}}/cmdline', 'rb').read() else []
        except OSError:
            pass
print(sorted(others), marked)
"""
    after = await execute(server, probe)
    assert after["status"] == "ok", after
    assert after["stdout"] == "[] []\n", after  # nothing of the earlier run is alive in this sandbox
    await still_fine(server)


async def test_killing_its_parent(reward_server):
    code = "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print('no', type(e).__name__)\nprint('still here')\n"
    result = await execute(reward_server, code)
    assert result["status"] in ("ok", "runtime_error"), result
    await still_fine(reward_server)


async def test_deleting_files_outside_tmp(reward_server, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.chmod(tmp_path, 0o777)
    code = f"""
import os, shutil
for path in [{str(victim)!r}, "/usr/bin/python3", "/opt/tandem/agent.py", "/lib64"]:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        print("DELETED", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
for path in ["/x", "/usr/x", "/opt/tandem/x"]:
    try:
        open(path, "w").write("x")
        print("WROTE", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
"""
    result = await execute(reward_server, code)
    assert result["status"] == "ok", result
    assert "DELETED" not in result["stdout"] and "WROTE" not in result["stdout"], result["stdout"]
    assert victim.read_text() == "keep me"
    assert Path("/usr/bin/python3").exists()
    await still_fine(reward_server)


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_one_hostile_program_does_not_stall_the_others(reward_server):
    hog = {**FAST, "wall_s": 10.0, "cpu_s": 10.0}
    slow = asyncio.create_task(execute(reward_server, "while True:\n    pass\n", hog))
    await asyncio.sleep(0.3)  # a head start for the hog; nothing below depends on how long it took
    quick = await execute(reward_server, "print(6 * 7)")
    assert quick["stdout"] == "42\n"
    assert not slow.done()  # served by the other worker while the hog still runs, not after it
    assert (await slow)["status"] == "timeout"
