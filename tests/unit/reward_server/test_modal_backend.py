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
        self.sandbox = SimpleNamespace(exec=Aio(process, self.calls, "exec"), terminate=Aio(None, self.calls, "terminate"),
                                       poll=Aio(None))  # None: still running
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


# --- sandboxes that died or are about to: a mock of Modal's cloud with a fleet of sandboxes ---------------

ACCEPTED = json.dumps({"accepted": True}).encode()


class MockSandboxFleet:
    """A mock of the ``modal`` module whose ``Sandbox.create`` makes a new sandbox each time, with the
    behaviour Modal documents: ``poll()`` is None while it runs, its exit code once it ended (lifetime
    ``timeout`` or ``idle_timeout`` reached, here at the mock clock's time); an exec on an ended
    sandbox raises Modal's error. ``broken`` sandboxes die as their first exec starts (the agent never
    answers ``accepted``)."""

    class Error(Exception):
        pass

    def __init__(self, clock, broken: int = 0):
        self.clock, self.broken = clock, broken
        self.created: list[SimpleNamespace] = []
        self.execs: list[int] = []  # which sandbox (index) each exec ran in
        fleet = self

        async def create(app=None, image=None, **kw):
            i = len(fleet.created)
            sb = SimpleNamespace(i=i, born=fleet.clock(), used=fleet.clock(), ended=None, kw=kw,
                                 broken=i < fleet.broken)
            sb.poll = Aio(lambda: fleet._poll(sb))
            sb.exec = Aio(None)
            sb.exec.aio = lambda *a, **k: fleet._exec(sb)
            sb.terminate = Aio(lambda: setattr(sb, "ended", 137))
            fleet.created.append(sb)
            return sb

        image = SimpleNamespace(run_commands=lambda *a, **k: image)
        self.Image = SimpleNamespace(debian_slim=lambda python_version=None: image)
        self.App = SimpleNamespace(lookup=Aio("app"))
        self.Sandbox = SimpleNamespace(create=SimpleNamespace(aio=create))
        self.exception = SimpleNamespace(Error=MockSandboxFleet.Error)

    def _poll(self, sb):
        now = self.clock()
        if sb.ended is None and (now - sb.born >= sb.kw["timeout"] or now - sb.used >= sb.kw["idle_timeout"]):
            sb.ended = 124
        return sb.ended

    async def _exec(self, sb):
        if self._poll(sb) is not None:
            raise MockSandboxFleet.Error(f"Sandbox {sb.i} has already finished")
        sb.used = self.clock()
        self.execs.append(sb.i)
        if sb.broken:
            sb.ended = 1
            out = b""
        else:
            out = struct.pack(">I", len(ACCEPTED)) + ACCEPTED + answer_frame([OK_RUN])
        stream = SimpleNamespace(read=Aio(out))
        stdin = SimpleNamespace(write=lambda data: None, write_eof=lambda: None, drain=Aio(None))
        return SimpleNamespace(stdin=stdin, stdout=stream, stderr=SimpleNamespace(read=Aio(b"agent died")),
                               wait=Aio(1 if sb.broken else 0))


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fleet_backend(fleet, clock, **options) -> ModalSandbox:
    opts = ModalOptions(pool=1, spawns_per_s=1000, **options)
    backend = ModalSandbox(opts, api=ModalApi(opts, modal_module=fleet))
    backend.pool._clock = clock  # the pool's ages on the mock's clock
    return backend


async def test_a_sandbox_past_its_idle_timeout_is_replaced_not_handed_out():
    clock = FakeClock()
    fleet = MockSandboxFleet(clock)
    backend = fleet_backend(fleet, clock, lifetime_s=3600, idle_timeout_s=600)
    assert (await backend.run(JOB))[0].status == "ok"
    clock.t += 650  # an idle gap longer than Modal's idle_timeout: that sandbox is gone
    (outcome,) = await backend.run(JOB)
    assert outcome.status == "ok"
    assert fleet.execs == [0, 1], "the job must run in a new sandbox, not the dead one"
    await backend.close()


async def test_a_sandbox_is_retired_before_its_lifetime_ends():
    clock = FakeClock()
    fleet = MockSandboxFleet(clock)
    backend = fleet_backend(fleet, clock, lifetime_s=3600, idle_timeout_s=600, retire_margin_s=120)
    for _ in range(10):  # busy (never idle for long), but ageing
        assert (await backend.run(JOB))[0].status == "ok"
        clock.t += 350
    assert fleet.execs == [0] * 10
    # now 3500 s old: alive, but within 120 s of its 3600 s lifetime: retired before a job meets its end
    assert fleet._poll(fleet.created[0]) is None
    assert (await backend.run(JOB))[0].status == "ok"
    assert fleet.execs[-1] == 1 and fleet.created[0].ended == 137  # terminated by the pool
    assert backend.pool.retired_stale == 1
    await backend.close()


async def test_the_sweep_replaces_idle_sandboxes_before_a_job_needs_one():
    clock = FakeClock()
    fleet = MockSandboxFleet(clock)
    backend = fleet_backend(fleet, clock, lifetime_s=3600, idle_timeout_s=600, retire_margin_s=120)
    await backend.start()
    clock.t += 500  # idle 500 s: past idle_timeout - margin
    assert await backend.pool.sweep() == 1
    for _ in range(200):
        if len(fleet.created) == 2 and backend.pool.live == 1:
            break
        await asyncio.sleep(0.01)
    assert len(fleet.created) == 2 and fleet.created[0].ended == 137
    await backend.close()


async def test_a_job_whose_sandbox_died_before_accepting_it_runs_again_in_another():
    clock = FakeClock()
    fleet = MockSandboxFleet(clock, broken=1)
    backend = fleet_backend(fleet, clock)
    (outcome,) = await backend.run(JOB)
    assert outcome.status == "ok" and fleet.execs == [0, 1]
    await backend.close()
    both = MockSandboxFleet(clock, broken=2)  # twice in a row: the infrastructure is broken, no score
    backend = fleet_backend(both, clock)
    with pytest.raises(SandboxError, match="first sandbox failed too"):
        await backend.run(JOB)
    await backend.close()
