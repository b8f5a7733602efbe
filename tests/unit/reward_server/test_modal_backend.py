"""The Modal backend's request building, against a mock of the ``modal`` SDK (Modal's cloud is
not reachable here), plus a live test that runs only with Modal credentials."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from types import SimpleNamespace

import pytest

from reward_server.sandbox.base import Job, SandboxError, python_run
from reward_server.sandbox.modal import (
    ModalApi,
    ModalOptions,
    ModalSandbox,
    exec_args,
    guest_files,
    outcome_of_exec,
    sandbox_kwargs,
)
from services.reward_specs import Limits


def answer_frame(runs: list[dict]) -> bytes:
    body = json.dumps({"runs": runs}).encode()
    return struct.pack(">I", len(body)) + body


OK_RUN = {"status": "ok", "detail": "", "exit_code": 0, "stdout": "4\n", "stderr": "", "wall_s": 0.1,
          "cpu_s": 0.05, "truncated": False, "results": None}


class Aio:
    """A method with the SDK's ``.aio`` async variant, recording its calls."""

    def __init__(self, result=None, calls=None, name=""):
        self.result, self.calls, self.name = result, calls if calls is not None else [], name

    async def aio(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return self.result() if callable(self.result) else self.result


class MockModal:
    """A mock of the ``modal`` module: records what tandem asks of Modal's API."""

    def __init__(self, returncode=0, stdout=b""):
        self.calls: list = []
        self.stdin = bytearray()
        self.eof = False
        mock = self

        class Stdin:
            def write(self, data):
                mock.stdin += data

            def write_eof(self):
                mock.eof = True

            drain = Aio(None, self.calls, "drain")

        process = SimpleNamespace(stdin=Stdin(), stdout=SimpleNamespace(read=Aio(stdout, self.calls, "stdout")),
                                  stderr=SimpleNamespace(read=Aio(b"", self.calls, "stderr")),
                                  wait=Aio(returncode, self.calls, "wait"))
        self.sandbox = SimpleNamespace(exec=Aio(process, self.calls, "exec"), terminate=Aio(None, self.calls, "terminate"))
        self.images: list[str] = []

        class Image:
            @staticmethod
            def debian_slim(python_version=None):
                mock.calls.append(("debian_slim", (), {"python_version": python_version}))
                return Image()

            def run_commands(self, command):
                mock.images.append(command)
                return self

        self.Image = Image
        self.App = SimpleNamespace(lookup=Aio("app", self.calls, "lookup"))
        self.Sandbox = SimpleNamespace(create=Aio(self.sandbox, self.calls, "create"))
        self.exception = SimpleNamespace(Error=RuntimeError)


JOB = Job(files={"main.py": "print(2+2)"}, runs=[python_run("python3")], limits=Limits(wall_s=3))


def test_sandbox_kwargs_block_the_network_and_bound_resources():
    kw = sandbox_kwargs(ModalOptions(cpu=0.5, memory_mb=512, lifetime_s=600))
    assert kw["block_network"] is True
    assert (kw["cpu"], kw["memory"], kw["timeout"]) == (0.5, 512, 600)
    argv, timeout = exec_args(JOB)
    assert argv[:3] == ["python3", "-I", "/opt/tandem/agent.py"] and "--oneshot" in argv
    assert timeout >= JOB.limits.wall_s
    assert {"/opt/tandem/agent.py", "/opt/tandem/boot.py", "/opt/tandem/harness.py"} <= set(guest_files())


def test_timed_out_exec_maps_to_timeout():
    (outcome,) = outcome_of_exec(JOB, -1, b"", "")
    assert outcome.status == "timeout"
    with pytest.raises(SandboxError):
        outcome_of_exec(JOB, 1, b"", "Traceback ...")
    assert outcome_of_exec(JOB, 0, answer_frame([OK_RUN]), "")[0].stdout == "4\n"


async def test_requests_sent_to_modal():
    mock = MockModal(stdout=answer_frame([OK_RUN]))
    backend = ModalSandbox(ModalOptions(pool=1, spawns_per_s=100), api=ModalApi(ModalOptions(pool=1), modal_module=mock))
    (outcome,) = await backend.run(JOB)
    assert outcome.status == "ok" and outcome.stdout == "4\n"
    names = [c[0] for c in mock.calls]
    assert names[:3] == ["lookup", "debian_slim", "create"]
    create = next(c for c in mock.calls if c[0] == "create")[2]
    assert create["block_network"] is True and create["app"] == "app"
    assert any("/opt/tandem/agent.py" in cmd for cmd in mock.images)  # guest code baked into the image
    exec_call = next(c for c in mock.calls if c[0] == "exec")
    assert exec_call[1][:3] == ("python3", "-I", "/opt/tandem/agent.py") and exec_call[2]["timeout"] > 3
    (size,) = struct.unpack(">I", bytes(mock.stdin[:4]))
    assert json.loads(bytes(mock.stdin[4 : 4 + size]))["files"] == {"main.py": "print(2+2)"} and mock.eof
    await backend.close()
    assert "terminate" in [c[0] for c in mock.calls]


async def test_timed_out_sandbox_is_replaced():
    mock = MockModal(returncode=-1)
    backend = ModalSandbox(ModalOptions(pool=1, spawns_per_s=100), api=ModalApi(ModalOptions(pool=1), modal_module=mock))
    (outcome,) = await backend.run(JOB)
    assert outcome.status == "timeout"
    for _ in range(200):  # the replacement is created in the background
        if [c[0] for c in mock.calls].count("create") == 2:
            break
        await asyncio.sleep(0.01)
    assert [c[0] for c in mock.calls].count("create") == 2
    await backend.close()


def modal_credentials() -> bool:
    return bool(os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")) or os.path.exists(
        os.path.expanduser("~/.modal.toml"))


@pytest.mark.modal
@pytest.mark.skipif(not modal_credentials(), reason="no Modal credentials")
async def test_live_modal_sandbox():
    backend = ModalSandbox(ModalOptions(pool=1))
    try:
        (ok,) = await backend.run(JOB)
        assert ok.status == "ok" and ok.stdout == "4\n"
        net = Job(files={"main.py": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)"},
                  runs=[python_run("python3")], limits=Limits(wall_s=5))
        assert (await backend.run(net))[0].status == "runtime_error"
    finally:
        await backend.close()
