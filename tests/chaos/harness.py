"""Fault injection on a real ``tandem up`` stack training an example task.

:func:`run_chaos` starts ``tandem up`` (embedded Redis, reward, control,
rollout with vLLM, learner with DeepSpeed) on an example's bootstrapped model
(``examples/arith``, or ``examples/tool_arith``, whose lines are multi-turn
episodes with the calculator tool: docs/episodes.md),
measures held-out accuracy, submits the run with ``tandem submit``, and
injects each :class:`Fault` when the run reaches its step: ``kill`` sends
SIGKILL to the service's main process (the supervisor restarts it; Redis
restarts on its AOF), ``pause`` sends SIGSTOP to its whole process group for
longer than its clients' timeouts, then SIGCONT. For each fault it records
how long recovery took: until the service runs again (a new pid, healthy) and
the run has trained past the step it had reached when the fault hit (for a
pause: counted from SIGCONT).

When the run has finished it checks what the issue asks: the run finished
its steps; ``tandem audit`` passes (every group accounted for once, none
trained twice, staleness within eta, versions contiguous and loaded as
published); held-out accuracy rose; and after ``tandem up`` is stopped no
process of any service's process group is alive and the stack's own
``TMPDIR`` (sandbox state, scratch files) is empty. It also keeps what shows
that episodes were trained: the audit's ``episodes`` (the trained groups whose
ledger entry records turns and tool calls) and the means over the learner's
steps of its episode figures (as summary.json's ``episodes``). Open file descriptors
of each service are counted before the run, once the last fault is
recovered from, and at the end (they must not grow after the middle count:
connection pools reach their size while the run warms up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from broker.ledger import read_file
from deploy.audit import find_ledger
from deploy.main_job import EPISODE_MEANS
from host.processes import die_with_parent, group_members
from services import wire
from services.clients import ControlClient, RewardClient, RolloutClient
from services.config import load_run_config
from services.evaluate import evaluate, load_eval_set
from services.run_states import TERMINAL_STATES

ROOT = Path(__file__).resolve().parents[2]
ETA = 1
SCORE_TIMEOUT_S = 5.0
"""The rollout server's reward-call timeout in the chaos stack: a paused reward server outlasts it."""
LEASE_S = 20.0
"""Admission lease and visibility timeout in the chaos run: a paused rollout server outlasts them."""
SETTLE_STEPS = 2
"""Steps trained after the last fault's recovery before the services' fds are counted for the leak check."""


@dataclass(frozen=True)
class Fault:
    service: str
    """learner, rollout, reward, control or redis."""
    action: str
    """``kill`` (SIGKILL, then the supervisor restarts it) or ``pause`` (SIGSTOP the process group)."""
    at_step: int
    pause_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.action} {self.service}" + (f" {self.pause_s:g} s" if self.action == "pause" else "")


@dataclass
class Outcome:
    fault: str
    at_step: int
    recovery_s: float
    """kill: from the signal; pause: from SIGCONT; until the service is back and the run trained past ``at_step``."""
    old_pid: int
    new_pid: int


@dataclass
class Report:
    steps: int
    outcomes: list[Outcome] = field(default_factory=list)
    audit: dict = field(default_factory=dict)
    audit_exit: int | None = None
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    final_state: str = ""
    wall_s: float = 0.0
    fds_before: dict[str, int] = field(default_factory=dict)
    """Open fds of each service before the run."""
    fds_mid: dict[str, int] = field(default_factory=dict)
    """... :data:`SETTLE_STEPS` steps after the last fault was recovered from: a Redis restart closes
    every pooled connection, and the pools reopen them only as they are used again."""
    fds_after: dict[str, int] = field(default_factory=dict)
    """... at the end of the run (services with the same pid as at ``fds_mid`` only)."""
    fd_kinds_mid: dict[str, dict[str, int]] = field(default_factory=dict)
    """What those fds are (:func:`_fd_kinds`), at ``fds_mid`` and at ``fds_after``: to read a growth."""
    fd_kinds_after: dict[str, dict[str, int]] = field(default_factory=dict)
    leftover_processes: list[int] = field(default_factory=list)
    leftover_tmp: list[str] = field(default_factory=list)
    up_exit: int | None = None
    train_points: int = 0
    """The learner's per-step metric points (one per step trained, a step done again after a crash twice)."""
    episode_points: int = 0
    """... of which carried episode figures (``learner.trainer.episode_means``: the step trained episodes)."""
    episodes: dict[str, float | None] = field(default_factory=dict)
    """Their means over those points: ``episode_turns_mean``, ``tool_calls_mean``, ``tool_success_frac``."""
    readmitted: int = 0
    """Groups the ledger shows admitted more than once: in flight on a rollout server that died (or past
    their lease), and generated again."""

    def table(self) -> str:
        """The reliability table of docs/reliability.md, one row per fault."""
        rows = ["| fault | at step | recovery (s) | groups lost | trained twice | audit |", "|---|---|---|---|---|---|"]
        verdict = "pass" if self.audit.get("ok") else "FAIL"
        for o in self.outcomes:
            rows.append(f"| {o.fault} | {o.at_step} | {o.recovery_s:.1f} | {self.audit.get('lost')} | "
                        f"{self.audit.get('trained_twice')} | {verdict} |")
        return "\n".join(rows)


def write_config(tmp: Path, model: Path, steps: int, *, faults: bool = True, example: str = "arith") -> Path:
    """``examples/<example>/run.toml`` on ``model`` with ``steps`` steps and eta = :data:`ETA`; with
    ``faults``, a checkpoint every 5 steps and leases of :data:`LEASE_S` as well (``tests/e2e`` uses the
    example's)."""
    here = ROOT / "examples" / example
    text = (here / "run.toml").read_text()
    raw = tomllib.loads(text)
    text = text.replace(raw["model"]["path"], str(model))
    text = text.replace('train = "train.jsonl"', f'train = "{here / "train.jsonl"}"')
    text = text.replace('eval = "eval.jsonl"', f'eval = "{here / "eval.jsonl"}"')
    text = text.replace(f"steps = {raw['learner']['steps']}", f"steps = {steps}")
    staleness = f"max_staleness = {ETA}"
    if faults:
        if "checkpoint_every" in raw["learner"]:
            text = text.replace(f"checkpoint_every = {raw['learner']['checkpoint_every']}", "checkpoint_every = 5")
        else:
            text = text.replace(f"steps = {steps}", f"steps = {steps}\ncheckpoint_every = 5")
        staleness += f"\nlease_s = {LEASE_S}\nvisibility_timeout_s = {LEASE_S}"
    text = text.replace(f"max_staleness = {raw['staleness']['max_staleness']}", staleness)
    path = tmp / "run.toml"
    path.write_text(text + "\n")
    cfg = load_run_config(path)
    assert (cfg.learner.steps, cfg.staleness.max_staleness) == (steps, ETA)
    assert not faults or (cfg.learner.checkpoint_every, cfg.staleness.lease_s) == (5, LEASE_S)
    return path


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return -1


def _fd_kinds(pid: int) -> dict[str, int]:
    """The process's open fds by kind: ``socket``, ``pipe``, ``anon_inode:[eventfd]``, or a file's directory."""
    kinds: Counter[str] = Counter()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")  # "socket:[123]", "pipe:[45]", "anon_inode:[...]"
                if target.startswith("/"):
                    kinds[os.path.dirname(target)] += 1
                else:
                    kinds[target if target.startswith("anon_inode") else target.split(":")[0]] += 1
    return dict(kinds)


class ChaosStack:
    def __init__(self, tmp: Path, config: Path, stack_env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.config_path = config
        self.config = load_run_config(config)
        self.dir = tmp / "stack"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
        self.env["TANDEM_ROLLOUT_SCORE_TIMEOUT_S"] = str(SCORE_TIMEOUT_S)
        # the stack's own temporary directory: whatever is left in it leaked (short: vLLM's IPC socket
        # paths under it may not exceed 107 bytes)
        self.tmpdir = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
        self.env["TMPDIR"] = str(self.tmpdir)
        self.env.update(stack_env or {})
        self.pgids: set[int] = set()
        self.up: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900) -> None:
        self.up = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "up", "--config", str(self.config_path), "--run-dir", str(self.dir)],
            env=self.env, stdout=open(self.tmp / "up.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while not (self.dir / "stack.json").exists():
            assert self.up.poll() is None, self.log_tail()
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(1)
        info = self.info()
        self.urls, self.token = info["urls"], info["token"]

    def info(self) -> dict:
        for _ in range(50):  # rewritten (atomically) after each restart
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                info = json.loads((self.dir / "stack.json").read_text())
                self.pgids.update(info["services"].values())
                return info
            time.sleep(0.1)
        raise AssertionError("stack.json unreadable")

    def pid(self, service: str) -> int:
        return self.info()["services"][service]

    def healthy(self, service: str) -> bool:
        import httpx

        if service == "redis":
            return True  # its pid changed and the services reach it: judged by progress
        try:
            return httpx.get(f"{self.urls[service]}/healthz", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, n: int = 4000) -> str:
        return (self.tmp / "up.log").read_bytes()[-n:].decode(errors="replace")

    async def eval_accuracy(self) -> float:
        items = load_eval_set(self.config.data.eval, self.config, None)
        async with RolloutClient(self.urls["rollout"], self.token) as r, RewardClient(self.urls["reward"], self.token) as s:
            return (await evaluate(r, s, items, self.config)).accuracy

    def submit(self) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "submit", str(self.config.data.train), "--config",
             str(self.config_path), "--url", self.urls["control"]],
            env={**self.env, "TANDEM_TOKEN": self.token}, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    async def status(self, run_id: str) -> wire.RunStatus | None:
        """The run's status, or None while the control plane (or Redis) is down."""
        try:
            async with ControlClient(self.urls["control"], self.token, attempts=1) as c:
                return await c.run_status(run_id)
        except Exception:  # noqa: BLE001  (down on purpose: try again)
            return None

    async def wait(self, run_id: str, predicate, timeout_s: float, what: str) -> wire.RunStatus:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.up.poll() is None, f"tandem up exited waiting for {what}:\n{self.log_tail()}"
            st = await self.status(run_id)
            if st is not None and predicate(st):
                return st
            assert time.monotonic() < deadline, f"timed out waiting for {what} ({st and st.run}):\n{self.log_tail()}"
            await asyncio.sleep(0.5)

    async def inject(self, run_id: str, fault: Fault, timeout_s: float = 600) -> Outcome:
        # a rollout server is killed with groups in flight on it (what its fault is about): with generation
        # the faster side, it may be idle at the step, every group of the next one already queued
        busy = fault.service != "rollout" or fault.action != "kill"
        st = await self.wait(run_id, lambda s: s.run.step >= fault.at_step and (busy or s.staleness.in_flight > 0),
                             timeout_s, f"step {fault.at_step}" + ("" if busy else " with groups in flight"))
        reached = st.run.step
        old = self.pid(fault.service)
        if fault.action == "kill":
            t0 = time.monotonic()
            os.kill(old, signal.SIGKILL)
        else:
            os.killpg(old, signal.SIGSTOP)
            time.sleep(fault.pause_s)
            os.killpg(old, signal.SIGCONT)
            t0 = time.monotonic()
            reached = max(reached, (await self.wait(run_id, lambda s: True, 60, "status")).run.step)
        while True:
            new = self.pid(fault.service)
            if (fault.action == "pause" or new != old) and self.healthy(fault.service):
                break
            assert self.up.poll() is None, f"tandem up exited after {fault.name}:\n{self.log_tail()}"
            assert time.monotonic() - t0 < timeout_s, f"{fault.service} did not come back after {fault.name}"
            await asyncio.sleep(0.3)
        final = self.config.learner.steps
        await self.wait(run_id, lambda s: s.run.step > reached or s.run.step >= final, timeout_s,
                        f"progress past step {reached} after {fault.name}")
        return Outcome(fault.name, reached, round(time.monotonic() - t0, 1), old, new)

    async def serve_final(self, run_id: str) -> None:
        """Make the rollout server serve the run's last version (for the eval after)."""
        from broker import Keys, WeightRegistry, connect

        client = connect(self.info()["redis_url"])
        try:
            wv = await WeightRegistry(client, Keys(run_id)).latest()
        finally:
            await client.aclose()
        async with RolloutClient(self.urls["rollout"], self.token, max_total_s=120) as r:
            if (await r.weights()).version < wv.version:
                await r.load_weights(wire.LoadWeights(version=wv.version, uri=wv.uri, sha256=wv.sha256))

    async def train_points(self, run_id: str) -> list[wire.MetricPoint]:
        """The learner's per-step points of the run's metrics."""
        async with ControlClient(self.urls["control"], self.token) as c:
            return [p for p in await c.metrics(run_id) if p.source == "learner"]

    def service_fds(self) -> dict[str, int]:
        return {name: _fds(pid) for name, pid in self.info()["services"].items()}

    def service_fd_kinds(self) -> dict[str, dict[str, int]]:
        return {name: _fd_kinds(pid) for name, pid in self.info()["services"].items()}

    def stop(self) -> int:
        self.up.send_signal(signal.SIGTERM)
        try:
            return self.up.wait(timeout=120)
        finally:
            if self.up.poll() is None:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait()


def run_chaos(tmp: Path, model: Path, steps: int, faults: list[Fault], stack_env: dict[str, str] | None = None,
              example: str = "arith") -> Report:
    """Train ``steps`` steps of ``examples/<example>`` under ``tandem up`` (``stack_env``: its
    ``TANDEM_STACK_*`` settings) while ``faults`` hit it, in order."""
    started = time.monotonic()
    stack = ChaosStack(tmp, write_config(tmp, model, steps, example=example), stack_env)
    report = Report(steps=steps)
    stack.start()
    try:
        report.accuracy_before = asyncio.run(stack.eval_accuracy())
        report.fds_before = stack.service_fds()
        run_id = stack.submit()
        for fault in faults:
            report.outcomes.append(asyncio.run(stack.inject(run_id, fault)))
        settled = min(steps - 1, max([o.at_step + 1 for o in report.outcomes], default=0) + SETTLE_STEPS)
        asyncio.run(stack.wait(run_id, lambda s: s.run.step >= settled or s.run.state in TERMINAL_STATES, 600,
                               f"step {settled} (pools warm again)"))
        report.fds_mid, mid = stack.service_fds(), dict(stack.info()["services"])
        report.fd_kinds_mid = stack.service_fd_kinds()
        final = asyncio.run(stack.wait(run_id, lambda s: s.run.state in TERMINAL_STATES, 1800, "the run's end"))
        report.final_state = final.run.state
        report.fds_after = {k: v for k, v in stack.service_fds().items() if mid.get(k) == stack.pid(k)}
        report.fd_kinds_after = {k: v for k, v in stack.service_fd_kinds().items() if k in report.fds_after}
        points = asyncio.run(stack.train_points(run_id))
        report.train_points = len(points)
        report.episode_points = sum("episode_turns_mean" in p.values for p in points)
        report.episodes = {name: (sum(xs) / len(xs) if xs else None) for name in EPISODE_MEANS
                           for xs in [[p.values[name] for p in points if name in p.values]]}
        if final.run.state == "finished":
            asyncio.run(stack.serve_final(run_id))
            report.accuracy_after = asyncio.run(stack.eval_accuracy())
        audited = subprocess.run([sys.executable, "-m", "deploy.cli", "audit", str(stack.dir), "--json"],
                                 env=stack.env, capture_output=True, text=True, timeout=120)
        report.audit_exit = audited.returncode
        report.audit = json.loads(audited.stdout) if audited.stdout.strip().startswith("{") else {"error": audited.stderr}
        with contextlib.suppress(FileNotFoundError):  # no ledger exported: the run did not finish (checked)
            admitted = Counter(e["g"] for e in read_file(find_ledger(stack.dir)) if e["e"] == "admitted")
            report.readmitted = sum(n > 1 for n in admitted.values())
    finally:
        report.up_exit = stack.stop()
        report.leftover_processes = [pid for pgid in sorted(stack.pgids) for pid in group_members(pgid)]
        report.leftover_tmp = sorted(p.name for p in stack.tmpdir.iterdir())
        shutil.rmtree(stack.tmpdir, ignore_errors=True)
        report.wall_s = round(time.monotonic() - started, 1)
    return report


def as_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2)
