"""Modal backend: jobs run in ``modal.Sandbox`` containers from a bounded warm pool.

Each warm sandbox is created with ``block_network=True``, a CPU and memory
reservation and a lifetime ``timeout``, from an image holding Python and
tandem's guest code at ``/opt/tandem``. A job is one
``sandbox.exec("python3", "-I", "/opt/tandem/agent.py", "--oneshot", ...)``:
the frame goes to the exec's stdin, the verdict frame comes from its stdout.
The agent is root in the container and runs with ``--warm``: before and
after each job it kills every process of any job uid and deletes what job
uids left in the shared writable places (``/tmp``, ``/var/tmp``,
``/dev/shm``, ...; made 0711/0700 so jobs cannot write there at all), and
each job gets a uid no earlier job of that container had, its own work dir
and its own IPC namespace (or its IPC objects removed after it).

Modal reports an exec that outlived its ``timeout`` with ``returncode == -1``
instead of raising; that is mapped to ``timeout``. Sandboxes are created at
most ``spawns_per_s`` per second (the pool's rate limit) and replaced after
``max_jobs`` jobs or any failure.

A Modal sandbox dies at its ``timeout`` (``lifetime_s``) and after
``idle_timeout`` (``idle_timeout_s``) without work, and ``modal.Sandbox``
has no ``alive`` attribute: the pool asks ``sandbox.poll()`` (None while it
runs) and retires a sandbox ``retire_margin_s`` before either deadline, when
it is about to be leased and on its periodic sweep. A job that fails before
the agent accepted it (the exec could not start, or the sandbox was gone)
runs once more in another sandbox: no program of the job ran, so the failure
is the infrastructure's, and one dead sandbox must not cost a group.

Everything that talks to Modal goes through :class:`ModalApi`, so the
request-building logic is unit-tested without the cloud.
"""

from __future__ import annotations

import base64
import logging
import struct
from dataclasses import dataclass
from typing import Any

from reward_server.sandbox.base import (
    GUEST_MOUNT,
    HEADER,
    Job,
    RunOutcome,
    Sandbox,
    SandboxError,
    parse_answer,
    unanswered,
)
from reward_server.sandbox.blame import SandboxEnded, is_accepted, run_blaming
from reward_server.sandbox.guest import GUEST_DIR
from reward_server.sandbox.pool import Pool

log = logging.getLogger("tandem.reward.modal")
MODAL_PYTHON = "python3"
EXEC_GRACE_S = 5


@dataclass(frozen=True)
class ModalOptions:
    app_name: str = "tandem-reward"
    pool: int = 4
    cpu: float = 1.0
    memory_mb: int = 1024
    lifetime_s: int = 3600
    idle_timeout_s: int = 600
    spawns_per_s: float = 2.0
    max_jobs: int = 500
    python_version: str = "3.11"
    retire_margin_s: int = 120
    """A sandbox is retired this long before its lifetime or idle timeout ends (at least the longest job)."""

    def __post_init__(self) -> None:
        if self.retire_margin_s >= min(self.lifetime_s, self.idle_timeout_s):
            raise ValueError(f"retire_margin_s ({self.retire_margin_s}) must be below the sandbox's lifetime "
                             f"({self.lifetime_s}) and idle timeout ({self.idle_timeout_s})")


def sandbox_kwargs(options: ModalOptions) -> dict[str, Any]:
    """Keyword arguments of ``modal.Sandbox.create`` (besides app and image)."""
    return {
        "block_network": True,
        "cpu": options.cpu,
        "memory": options.memory_mb,
        "timeout": options.lifetime_s,
        "idle_timeout": options.idle_timeout_s,
        "workdir": "/tmp",
    }


def exec_args(job: Job) -> tuple[list[str], int]:
    """The argv and timeout (whole seconds) of the exec that runs ``job``."""
    argv = [MODAL_PYTHON, "-I", f"{GUEST_MOUNT}/agent.py", "--oneshot", "/tmp", "--warm"]
    return argv, int(job.backstop_s()) + EXEC_GRACE_S


def guest_files() -> dict[str, str]:
    """Guest code for the image: sandbox path -> source."""
    return {f"{GUEST_MOUNT}/{p.name}": p.read_text() for p in sorted(GUEST_DIR.glob("*.py"))}


def split_frames(stdout: bytes) -> list[bytes]:
    """The complete frame bodies at the start of ``stdout``."""
    bodies, at = [], 0
    while len(stdout) - at >= HEADER.size:
        (size,) = struct.unpack(">I", stdout[at : at + HEADER.size])
        body = stdout[at + HEADER.size : at + HEADER.size + size]
        if len(body) < size:
            break
        bodies.append(body)
        at += HEADER.size + size
    return bodies


def outcome_of_exec(job: Job, returncode: int | None, stdout: bytes, stderr: str) -> list[RunOutcome]:
    """Verdicts from a finished exec: its returncode and raw stdout (``accepted``, then the answer)."""
    if returncode == -1:  # Modal: the exec hit its timeout (it does not raise)
        return unanswered(job, "modal exec timed out")
    bodies = split_frames(stdout)
    if bodies and is_accepted(bodies[0]):
        if len(bodies) < 2:
            raise SandboxEnded(f"modal exec ended ({returncode}) while the job ran: {stderr[-300:]}")
        return parse_answer(bodies[1], job)
    if not bodies:
        raise SandboxError(f"modal exec returned {returncode} without an answer: {stderr[-300:]}")
    return parse_answer(bodies[0], job)


class ModalApi:
    """The thin layer over the ``modal`` package (async interface)."""

    def __init__(self, options: ModalOptions, modal_module: Any | None = None) -> None:
        if modal_module is None:
            import modal as modal_module  # the real SDK; tests pass a mock of it, named as such

        modal = self.modal = modal_module
        self.options = options
        self.errors: tuple[type[BaseException], ...] = (modal.exception.Error,)
        self._app = None
        self._image = None

    async def create(self) -> Any:
        modal = self.modal
        if self._app is None:
            self._app = await modal.App.lookup.aio(self.options.app_name, create_if_missing=True)
            image = modal.Image.debian_slim(python_version=self.options.python_version)
            # The guest code travels inside the image (written by a build step, not a host mount).
            for path, source in guest_files().items():
                encoded = base64.b64encode(source.encode()).decode()
                image = image.run_commands(f"mkdir -p {GUEST_MOUNT} && echo {encoded} | base64 -d > {path}")
            self._image = image
        return await modal.Sandbox.create.aio(app=self._app, image=self._image, **sandbox_kwargs(self.options))

    async def run(self, sandbox: Any, job: Job) -> list[RunOutcome]:
        argv, timeout = exec_args(job)
        proc = await sandbox.exec.aio(*argv, timeout=timeout, text=False)
        proc.stdin.write(job.frame())
        proc.stdin.write_eof()
        await proc.stdin.drain.aio()
        stdout = await proc.stdout.read.aio()
        stderr = await proc.stderr.read.aio()
        returncode = await proc.wait.aio()
        return outcome_of_exec(job, returncode, stdout, stderr.decode(errors="replace"))

    async def terminate(self, sandbox: Any) -> None:
        await sandbox.terminate.aio()

    async def alive(self, sandbox: Any) -> bool:
        """Modal's ``Sandbox.poll()``: None while the sandbox runs, its exit code once it ended."""
        try:
            return await sandbox.poll.aio() is None
        except self.errors as e:
            raise SandboxError(f"modal sandbox poll failed: {e!r}") from e


class ModalSandbox(Sandbox):
    name = "modal"
    python = MODAL_PYTHON

    def __init__(self, options: ModalOptions, api: Any | None = None) -> None:
        self.options = options
        self.api = api if api is not None else ModalApi(options)
        margin = options.retire_margin_s
        self.pool: Pool[Any] = Pool(self.api.create, self.api.terminate, size=options.pool,
                                    max_uses=options.max_jobs, min_spawn_interval_s=1.0 / options.spawns_per_s,
                                    alive=self.api.alive, max_age_s=options.lifetime_s - margin,
                                    max_idle_s=options.idle_timeout_s - margin,
                                    sweep_s=min(30.0, margin / 2))

    async def start(self) -> None:
        await self.pool.start()

    async def run(self, job: Job) -> list[RunOutcome]:
        return await run_blaming(self._attempt_twice, job, self.python)

    async def _attempt_twice(self, job: Job) -> list[RunOutcome]:
        """:meth:`_attempt`, and once more in another sandbox when the first failed before the agent
        accepted the job (after that, :func:`run_blaming` decides who ended the sandbox)."""
        try:
            return await self._attempt(job)
        except SandboxEnded:
            raise
        except SandboxError as first:
            log.warning("a modal sandbox failed before it accepted a job (%s); running it in another", first)
            try:
                return await self._attempt(job)
            except SandboxEnded:
                raise
            except SandboxError as second:
                raise SandboxError(f"{second}; the first sandbox failed too: {first}") from second

    async def _attempt(self, job: Job) -> list[RunOutcome]:
        async with self.pool.borrow() as loan:
            try:
                outcomes = await self.api.run(loan.item, job)
            except SandboxError:
                loan.discard()
                raise
            except (OSError, TimeoutError, *self.api.errors) as e:  # Modal's and transport errors
                loan.discard()
                raise SandboxError(f"modal sandbox failed: {e!r}") from e
            if any(o.status == "timeout" for o in outcomes):
                loan.discard()  # a program that ran out its time may have left work behind
            return outcomes

    async def close(self) -> None:
        await self.pool.close()
