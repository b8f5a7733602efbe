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
import time
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
    assert result["wall_s"] < 5
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


@pytest.mark.parametrize("host", ["127.0.0.1", "192.0.2.1"])  # loopback, and TEST-NET-1 (never routed)
async def test_network_is_unreachable(reward_server, host):
    code = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(1.0)\n"
        "try:\n"
        f"    s.connect(({host!r}, {reward_server.url.rsplit(':', 1)[1]}))\n"
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


async def test_background_process_does_not_outlive_the_run(reward_server, tmp_path):
    # The child writes a line every 0.1 s for 5 s; a second run looks for any of it.
    code = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c",
    "import time, os\\nfor i in range(50):\\n    time.sleep(0.1)\\n    open('/tmp/leak-%d' % os.getpid(), 'a').write('x')\\n"],
    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("spawned")
"""
    result = await execute(reward_server, code)
    assert result["status"] == "ok" and result["stdout"] == "spawned\n", result
    await asyncio.sleep(0.5)
    probe = "import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit() and int(p) > 2 and int(p) != os.getpid() and int(p) != os.getppid()))\n"
    after = await execute(reward_server, probe)
    assert after["status"] == "ok", after
    assert after["stdout"] == "[]\n", after  # nothing of the earlier run is alive in this sandbox
    await still_fine(reward_server)


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


async def test_one_hostile_program_does_not_stall_the_others(reward_server):
    slow = asyncio.create_task(execute(reward_server, "while True:\n    pass\n", {**FAST, "wall_s": 6.0, "cpu_s": 6.0}))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    quick = await execute(reward_server, "print(6 * 7)")
    assert quick["stdout"] == "42\n"
    assert time.monotonic() - started < 4.0  # served by the other worker, not after the hog
    assert (await slow)["status"] == "timeout"
