"""The learner's training loop: broker -> DeepSpeed step -> publish -> checkpoint -> ack.

Rank 0 talks to Redis (the :class:`~learner.feeder.Feeder` and the weight
registry) and tells the other ranks what to do with one broadcast per step
(their rows of the batch, whether to publish, checkpoint or stop); every
rank runs the collective parts (forward/backward, ZeRO-3 gathers,
checkpoint saves).

One step, in this order:

1. form the batch for ``v_learner + 1`` (acceptance judged now; stale and
   retracted groups acknowledged as dropped);
2. train one optimizer step on it; its groups are *held* (their admission
   tickets freed, their acknowledgement deferred);
3. every ``publish.every`` steps: gather the full weights, write version
   ``v_learner + 1`` atomically, register it, prune old versions
   (``learner.publisher``: the learner's side of the weight path);
4. when a checkpoint is due (every ``learner.checkpoint_every`` steps or
   ``learner.checkpoint_every_s`` seconds, after the last step, and when
   stopped on request: SIGTERM, not kill -9): save a checkpoint holding the
   step, ``v_learner``, each rank's RNG state, and the groups held since the
   last one (entry ids and their ledger details);
5. once the checkpoint is durable (on a Modal volume: committed by every
   node, since a retried learner sees committed files only), acknowledge
   the held groups: each becomes
   *done* with its ledger ``trained`` entry (``broker.ledger``). Steps 4 and
   5 are ``learner.checkpoints``.

Resume (kill -9 at any point, restart): a crash loses the steps after the
last checkpoint, and no data.

- The checkpoint named by the pointer file is loaded: weights, optimizer,
  LR schedule, RNG, step, ``v_learner``. The groups it records as held are
  acknowledged now (``Checkpoints.ack_restored``; idempotent: a group already
  done gets no second ledger entry), so a group trained into the checkpointed
  weights is never trained again.
- Groups trained *after* the checkpoint were never acknowledged: they are
  still pending, taken over at start-up (``Feeder.start``) and trained again
  in the resumed lineage, unless a retracted version generated them.
- Versions: let ``V`` be the checkpoint's ``v_learner`` and ``L`` the registry's
  latest. Publishing happens before the checkpoint of the same step, so
  ``L >= V``. If ``L == V``, numbering continues at ``V + 1``. If ``L > V``,
  versions ``V+1..L`` came from weights the resumed learner no longer has:
  they are *retracted* (``WeightRegistry.retract``: rollout servers may no
  longer load or generate with them, and their groups are dropped as
  ``retracted``), and the resumed weights are published at once as ``L + 1``.
  The sequence has no gap and no repeat (the registry refuses both), and
  staleness counts only the versions of the lineage (``broker.admission.lag``),
  so ``eta`` keeps its meaning after a crash.
- A version directory written but never registered (kill between write and
  register) is overwritten when that number is published; half-written temp
  directories are removed at start-up.

When the run ends (its last step, or the control plane stopped or failed
it) :func:`close_run` ends the groups left in the streams as
``run_finished``/``run_stopped``/``run_failed`` and exports the ledger to
``<run_dir>/<run_id>/ledger.jsonl``; ``tandem audit`` checks it.

Logs (``<run_dir>/<run_id>/learner/``): ``trained.jsonl`` (a line per step
this process trained: step, version, group ids, pid; steps a crash lost
appear there and again after the resume) and ``published.jsonl``.

In the code, rank 0's run is :meth:`Trainer._lead`: ``_resume`` once, then
per step ``_feed`` (1), ``_plan`` and ``_step`` (2), ``_publish`` (3:
:class:`~learner.publisher.Publisher`), ``_checkpoint`` (4 and 5:
:class:`~learner.checkpoints.Checkpoints`) and ``_report`` (status, metrics,
log, run registry); ``_finish`` at the end. What rank 0 tells the other ranks
is a :class:`~learner.ranks.RankCommand`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from broker.admission import lag
from broker.ledger import LEDGER_FILE
from host.files import write_atomic
from learner.advantages import group_advantages
from learner.checkpoints import Checkpoints
from learner.feeder import DataTimeout
from learner.publisher import Publisher, publish_tensors
from learner.ranks import RankChannel, RankCommand, receive
from learner.retention import RUN_CONFIG_FILE
from learner.settings import LearnerSettings
from learner.status import Status
from services.config import RunConfig
from services.runs import CompletionsLog
from services.timeline import Timeline

if TYPE_CHECKING:
    from broker import Delivery
    from learner.batch import TrainSeq
    from services.wire import TrajectoryGroup

log = logging.getLogger("tandem.learner")


class Paths:
    """Where one run's learner files live."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        base = Path(run_dir) / run_id
        self.ledger = base / LEDGER_FILE
        self.weights = base / "weights"
        self.checkpoints = base / "checkpoints"
        self.logs = base / "learner"
        self.config = base / RUN_CONFIG_FILE


def run_id_of(settings: LearnerSettings, cfg: RunConfig) -> str:
    return settings.run_id or cfg.name


def component_means(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """``reward_<name>``: the mean of each named reward component (a python reward function's) over the
    samples that carry it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for smp in (smp for g in groups for smp in g.samples):
        for name, value in smp.components.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {f"reward_{name}": sums[name] / counts[name] for name in sorted(sums)}


def reward_metric_means(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """``fn_<name>``: the mean over the step's groups of what python reward functions logged with
    ``log_metric(name, value)`` (TRL logs it as ``name``; the name lower-cased, other characters than letters,
    digits and ``_`` made ``_``, cut to 60)."""
    values: dict[str, list[float]] = {}
    for g in groups:
        for name, value in g.reward_metrics.items():
            values.setdefault("fn_" + re.sub(r"[^a-z0-9_]", "_", name.lower())[:60], []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}


def completion_rows(groups: list[TrajectoryGroup], step: int, n: int, advantage: str) -> list[dict]:
    """The step's ``n`` rows of the completions table (``logging.completions``): the first sample of each group
    in turn, then the second, ... (as many prompts as there are rows), each with its advantage in its group."""
    if n == 0:
        return []
    advantages = [group_advantages([smp.reward for smp in g.samples], advantage) for g in groups]
    order = sorted(((i, k) for k, g in enumerate(groups) for i in range(len(g.samples))))[:n]
    return [{"step": step, "version": groups[k].samples[i].policy_version, "group_id": groups[k].group_id,
             "prompt": groups[k].prompt, "completion": groups[k].samples[i].text, "reward": groups[k].samples[i].reward,
             "advantage": advantages[k][i], "logged": groups[k].samples[i].logged}
            for i, k in order]


def episode_means(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """For a step with multi-turn episodes (``rollout_server.episodes``): ``episode_turns_mean`` (the model's
    turns per episode), ``tool_calls_mean`` (calls per episode) and ``tool_success_frac`` (calls answered
    without an error, of all calls; only when there were calls). Empty for a step of single-turn samples."""
    samples = [smp for g in groups for smp in g.samples if smp.turn_versions]
    if not samples:
        return {}
    calls = sum(smp.tool_calls for smp in samples)
    out = {"episode_turns_mean": sum(smp.turns for smp in samples) / len(samples),
           "tool_calls_mean": calls / len(samples)}
    if calls:
        out["tool_success_frac"] = 1 - sum(smp.tool_errors for smp in samples) / calls
    return out


@dataclass(frozen=True)
class Batch:
    """One step's groups as the feeder handed them out (oldest first) and the rows built from them."""

    taken: list[tuple[Delivery, TrajectoryGroup]]
    seqs: list[TrainSeq]
    basis: int
    """``v_learner`` when the batch was formed (the step produces ``basis + 1``)."""
    lags: list[int]
    """``lag(basis, v)`` of each group: all within ``max_staleness``."""

    @property
    def deliveries(self) -> list[Delivery]:
        return [d for d, _ in self.taken]

    @property
    def groups(self) -> list[TrajectoryGroup]:
        return [g for _, g in self.taken]


class Trainer:
    """Runs the loop above on every rank; rank 0 also owns Redis, metrics and status."""

    def __init__(self, settings: LearnerSettings, cfg: RunConfig, metrics=None) -> None:
        self.settings = settings
        self.cfg = cfg
        self.run_id = run_id_of(settings, cfg)
        self.paths = Paths(settings.run_dir, self.run_id)
        self.status = Status(run_id=self.run_id, steps=cfg.learner.steps)
        self.metrics = metrics
        self.stop_event = threading.Event()
        self.step = 0
        """Optimizer steps taken (the checkpoint's after a resume)."""
        self.version = 0
        """v_learner: the newest version this learner published (the checkpoint's after a resume)."""
        self.timeline = Timeline.off()
        """Rank 0's spans (read, step, publish, checkpoint: services.timeline), the run's once it leads."""
        self.publisher: Publisher | None = None
        """Rank 0's, once it leads."""

    # -- entry points -------------------------------------------------------

    def run_blocking(self, *, reraise: bool = True) -> None:
        """Run to completion in this thread.

        A failure is recorded in ``status`` (``/healthz`` turns 503) and
        logged; it is re-raised unless ``reraise`` is false (the HTTP
        service's training thread, whose app keeps serving the failure).
        """
        try:
            asyncio.run(self.run())
        except Exception as e:
            self.status.state = "failed"
            self.status.error = f"{type(e).__name__}: {e}"
            log.exception("learner failed")
            if reraise:
                raise

    async def run(self) -> None:
        import torch

        from learner.engine import LearnerEngine

        incidents = None
        if self.settings.redis_url:
            from broker import Keys
            from services.watchdog import SyncIncidentLog

            incidents = SyncIncidentLog(self.settings.redis_url, Keys(self.run_id))
        engine = LearnerEngine(self.cfg, incidents=incidents)
        self.engine = engine
        self.status.rank_count = engine.world
        self.checkpoints = Checkpoints(engine, self.paths.checkpoints, self.cfg.learner, self.settings.run_dir_volume,
                                       self.status)
        state = engine.load(self.paths.checkpoints)
        self.step = state["step"] if state else 0
        self.version = state["version"] if state else 0
        self.status.resumed_from = self.step if state else None
        if engine.rank == 0:
            self.ranks = RankChannel(engine.world)
            try:
                await self._lead(state)
            except Exception:
                # release the other ranks (they wait in a broadcast); a failure inside a
                # collective cannot be helped (the send fails too: the first error is the one raised),
                # but a data timeout or a broker error can
                if not self.ranks.stopped:
                    with contextlib.suppress(RuntimeError):
                        self.ranks.send(RankCommand(step=self.step, stop=True, failed=True))
                raise
        elif not self._follow():
            raise RuntimeError("rank 0 failed; see its log")
        torch.distributed.barrier()

    # -- rank 0 -------------------------------------------------------------

    async def _lead(self, state: dict | None) -> None:
        """Rank 0's run: resume, then feed -> step -> publish -> checkpoint -> ack -> report."""
        import torch

        from broker import Keys, WeightRegistry, connect
        from learner.borrowed_cores import BorrowedCores
        from learner.crash import crash_point
        from learner.feeder import Feeder
        from services import weightstore as store

        if not self.settings.redis_url:
            raise RuntimeError("the learner needs a Redis URL (REDIS_URL)")
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        _write_json(self.paths.config, self.cfg.model_dump(mode="json"))  # what `tandem export` reads
        store.clean_temp(self.paths.weights)
        self.redis = connect(self.settings.redis_url)
        self.timeline = self.engine.timeline = Timeline(self.settings.redis_url, Keys(self.run_id), "learner").start()
        try:
            self.keys = Keys(self.run_id)
            if self.settings.borrow_threads and self.engine.world == 1 and self.engine.device.type == "cpu":
                self.engine.cores = BorrowedCores(self.settings.redis_url, self.keys, own=torch.get_num_threads(),
                                                  borrow=self.settings.borrow_threads)
            self.registry = WeightRegistry(self.redis, self.keys)
            self.publisher = Publisher(
                self.engine, self.cfg, self.settings, self.redis, self.keys, self.registry,
                weights=self.paths.weights, published_log=self.paths.logs / "published.jsonl", status=self.status,
                metrics=self.metrics, timeline=self.timeline,
            )
            self.feeder = Feeder(
                self.redis, self.keys, self.cfg, vocab_size=self.engine.vocab_size, max_len=self.engine.max_len,
                consumer=f"learner-{self.settings.name}",
            )
            await self._resume(state)
            self._t_start, self._idle_start = time.monotonic(), self.feeder.idle_s
            first = True
            while self.step < self.cfg.learner.steps and not self.stop_event.is_set():
                t0, idle0 = time.monotonic(), self.feeder.idle_s
                batch = await self._feed()
                if batch is None:
                    break
                cmd = self._plan(batch)
                stats, train_s = self._step(cmd)
                self.checkpoints.hold(self.step, batch.basis, batch.taken)
                if cmd.publish:
                    with self.timeline.span("publish", "rank0", step=self.step, version=self.version + 1):
                        await self._publish(self.version + 1, resume=False)
                # the batch's tickets are freed once the version it trained is published, not before: a
                # rollout server admitted meanwhile would start from the version before, whose groups the
                # step after next no longer accepts at eta = 1 (broker/admission.py)
                await self.feeder.hold(batch.deliveries)
                if cmd.publish:
                    crash_point("published", self.step, self.paths.checkpoints)  # published, not acked
                if cmd.checkpoint:
                    with self.timeline.span("checkpoint", "rank0", step=self.step):
                        await self._checkpoint()
                await self._report(batch, stats, train_s)
                if self.engine.cores is not None and not first:  # the first waited for the rollout side to start
                    waited = self.feeder.idle_s - idle0
                    self.engine.cores.step_ended(waited, time.monotonic() - t0 - waited)
                first = False
            await self._finish()
        finally:
            if self.publisher is not None:  # failing: a half-written version is cleaned at the next start
                await self.publisher.abandon()
            if self.engine.cores is not None:
                self.engine.cores.close()
                self.engine.cores = None
            await self.timeline.stop_async()
            await self.redis.aclose()

    async def _resume(self, state: dict | None) -> None:
        """Pick up where the checkpoint left off ("Resume" above)."""
        feeder = self.feeder
        await feeder.stream.ensure_group()
        await self.checkpoints.ack_restored(feeder.stream, state)
        await feeder.start()
        latest = await self.registry.latest()
        registered = latest.version if latest else 0
        announced = await self.publisher.announced()
        if registered < self.version:
            raise RuntimeError(
                f"the registry's latest version is {registered} but the checkpoint holds {self.version}: "
                "the broker lost data (is Redis persistent?)"
            )
        # a version broadcast in memory but never registered (the learner died before its files) was
        # served: its number is retracted with the others and never reused
        ahead = max(registered, announced)
        lost = max(0, self._last_trained_step() - self.step)
        await feeder.ledger.append("started", pid=os.getpid(), step=self.step, version=self.version,
                                   max_staleness=self.cfg.staleness.max_staleness, steps=self.cfg.learner.steps,
                                   groups_per_step=self.cfg.learner.groups_per_step, lost_steps=lost)
        if ahead > self.version:
            log.warning(
                "versions %d..%d were published after the last checkpoint (step %d; %d steps lost): retracting them "
                "and publishing the resumed weights as version %d",
                self.version + 1, ahead, self.step, lost, ahead + 1,
            )
            await self.registry.retract(list(range(self.version + 1, ahead + 1)),
                                        checkpoint_step=self.step, lost_steps=lost)
            self.ranks.send(RankCommand(step=self.step, publish=True))
            await self._publish(ahead + 1, resume=True)
        feeder.retracted = await self.registry.retracted()
        self.status.lost_steps += lost
        self.status.retracted = sorted(feeder.retracted)
        self.checkpoints.restored(self.step)
        self.status.step, self.status.version = self.step, self.version
        await self._write_state()

    async def _feed(self) -> Batch | None:
        """The next step's batch: groups acceptable for ``v_learner + 1`` that give at least one row.

        None when stopped while waiting; raises ``DataTimeout`` when no data comes.
        """
        from learner.batch import build_batch

        cfg = self.cfg
        while True:
            self.status.state = "waiting"
            t0 = time.monotonic()
            try:
                with self.timeline.span("read", "rank0", step=self.step + 1):  # the learner's data wait
                    taken = await self.feeder.next_batch(
                        self.version, cfg.learner.groups_per_step, cfg.learner.wait_timeout_s, stop=self.stop_event
                    )
            except DataTimeout as e:
                await self._starved(e, time.monotonic() - t0)
                raise
            if taken is None:
                return None
            seqs = build_batch([g for _, g in taken], cfg.loss, cfg.sampling.max_tokens)
            if seqs:
                return Batch(taken, seqs, basis=self.version,
                             lags=[lag(self.version, g.policy_version, self.feeder.retracted) for _, g in taken])
            # every completion was overlong-filtered or empty
            await self.feeder.stream.ack([d for d, _ in taken], counter="empty_dropped", event="dropped",
                                         details={"reason": "empty"})

    async def _starved(self, e: Exception, waited_s: float) -> None:
        """Record the starvation that fails the run as a watchdog incident (``tandem status``, dashboard)."""
        from broker import Stream
        from services.watchdog import IncidentLog, incident
        from services.wire import dropped_by_reason, dropped_text

        try:
            counters = {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.keys.counters)).items()}
            prompts = Stream.prompts(self.redis, self.keys)
            left = max(0, await prompts.backlog() - await prompts.pending())
            why = (f"{left} prompt groups not yet generated" if left else "nothing left to generate") + (
                f"; groups dropped so far: {dropped_text(dropped_by_reason(counters))}")
        except Exception as e2:  # noqa: BLE001  the record matters more than its detail
            why = f"(could not read the run's counters: {e2!r})"
        inc = incident(f"the learner of run {self.run_id} (step {self.step + 1})", f"trajectory groups: {e}; {why}",
                       waited_s=waited_s, limit_s=self.cfg.learner.wait_timeout_s, field="learner.wait_timeout_s",
                       action="the run fails", source="learner:rank0")
        try:
            await IncidentLog(self.redis, self.keys, source="learner:rank0").append(inc)
        except Exception as e2:  # noqa: BLE001  the timeout below matters more than its record
            log.error("could not record the incident: %r", e2)

    def _plan(self, batch: Batch) -> RankCommand:
        """What the step that trains ``batch`` does: every rank's rows, and whether it publishes and checkpoints."""
        from learner.batch import split_ranks

        step = self.step + 1
        return RankCommand(
            step=step,
            rows=split_ranks(batch.seqs, self.engine.world),
            publish=step % self.cfg.publish.every == 0,
            checkpoint=self.checkpoints.due(step),
        )

    def _step(self, cmd: RankCommand) -> tuple[dict[str, float], float]:
        """Tell the other ranks, then train this rank's rows (collective). Returns (stats, seconds)."""
        self.status.state = "training"
        self.ranks.send(cmd)
        t0 = time.monotonic()
        with self.timeline.span("step", "rank0", step=cmd.step):
            stats = self.engine.train_step(cmd.rows[0])
        self.step = cmd.step
        return stats, time.monotonic() - t0

    async def _publish(self, version: int, *, resume: bool) -> None:
        """Publish this step's weights as ``version`` (collective; ``learner.publisher``); it becomes v_learner."""
        await self.publisher.publish(version, self.step, resume=resume)
        self.version = version

    async def _checkpoint(self) -> None:
        """Save this step's checkpoint (collective) and acknowledge the groups it holds (``learner.checkpoints``)."""
        await self.publisher.written()  # a resume from it finds its version registered
        await self.checkpoints.save(self.step, self.version, self.feeder)

    async def _report(self, batch: Batch, stats: dict[str, float], train_s: float) -> None:
        """After the acknowledgement: status, audit line, metrics point, run registry, Prometheus, log."""
        feeder, st = self.feeder, self.status
        tokens = sum(s.length for s in batch.seqs)
        wall = time.monotonic() - self._t_start
        st.step, st.version = self.step, self.version
        st.last = stats | {"train_s": train_s, "groups": len(batch.taken), "sequences": len(batch.seqs)}
        st.tokens_per_s = tokens / max(train_s, 1e-9)
        st.idle_fraction = (feeder.idle_s - self._idle_start) / max(wall, 1e-9)
        st.counts = dict(feeder.counts)
        groups = batch.groups
        self._audit("trained.jsonl", {
            "step": self.step, "version": self.version, "pid": os.getpid(),
            "groups": [g.group_id for g in groups], "group_versions": [g.policy_version for g in groups],
        })
        rewards = [smp.reward for g in groups for smp in g.samples]
        lags = batch.lags
        point = {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and math.isfinite(v)} | {
            "reward_mean": sum(rewards) / len(rewards),
            "lag_max": float(max(lags)), "lag_mean": sum(lags) / len(lags),
            "stale_dropped": float(feeder.counts["stale_dropped"]),
            "zero_variance_dropped": float(feeder.counts["zero_variance_dropped"]),
            "learner_tokens_per_s": st.tokens_per_s,
            "learner_idle_frac": st.idle_fraction,
        } | component_means(groups) | reward_metric_means(groups) | episode_means(groups)
        await self._write_state(point)
        await CompletionsLog(self.redis, self.keys).append(
            completion_rows(groups, self.step, self.cfg.logging.completions, self.cfg.loss.advantage))
        if self.metrics is not None:
            self.metrics.observe_step(st, tokens)
        log.info(
            "step %d v%d loss %.4f kl %.4f entropy %.3f clip %.3f tokens/s %.0f idle %.2f",
            self.step, self.version, stats["loss"], stats["kl"], stats["entropy"], stats["clip_fraction"],
            st.tokens_per_s, st.idle_fraction,
        )

    async def _finish(self) -> None:
        """The loop ended (last step, or stopped): keep the progress, release the other ranks, report;
        a finished run's leftover groups are ended and its ledger exported."""
        await self.publisher.written()
        if self.checkpoints.saved_step < self.step:
            # stopped on request (SIGTERM): keep the progress and acknowledge what it trained
            self.ranks.send(RankCommand(step=self.step, checkpoint=True))
            await self._checkpoint()
        self.ranks.send(RankCommand(step=self.step, stop=True))
        done = self.step >= self.cfg.learner.steps
        if done:
            await close_run(self.redis, self.keys, "run_finished", self.paths.ledger, steps=self.step)
        self.status.state = "done" if done else "stopped"
        await self._write_state()

    def _last_trained_step(self) -> int:
        """The last step any learner of this run trained (its logs survive a crash): the newest line of
        ``trained.jsonl``, or of ``published.jsonl`` when a kill came after a step's publish but before
        its ``trained.jsonl`` line (written once the step is reported)."""
        return max(self._last_logged_step("trained.jsonl"), self._last_logged_step("published.jsonl"))

    def _last_logged_step(self, name: str) -> int:
        path = self.paths.logs / name
        if not path.exists():
            return 0
        lines = path.read_text().splitlines()
        try:
            return json.loads(lines[-1])["step"] if lines else 0
        except (ValueError, KeyError):  # a line cut by the crash
            return max((json.loads(x)["step"] for x in lines[:-1]), default=0)

    async def _write_state(self, point: dict | None = None) -> None:
        """Progress into the run registry (when the control plane knows the run) and the metrics log."""
        from services.runs import MetricsLog, RunStore, UnknownRun

        try:
            await RunStore(self.redis).update(self.run_id, step=self.step, policy_version=self.version)
        except UnknownRun:
            pass  # a run started without the control plane (tandem serve learner with TANDEM_RUN_ID)
        if point:
            await MetricsLog(self.redis, self.keys).append("learner", self.step, **point)

    def _audit(self, name: str, record: dict) -> None:
        with open(self.paths.logs / name, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    # -- ranks > 0 ------------------------------------------------------------

    def _follow(self) -> bool:
        """Carry out rank 0's commands until it says stop; False if it stopped because it failed."""
        import torch

        engine = self.engine
        while True:
            cmd = receive()
            if cmd.rows is not None:
                engine.train_step(cmd.rows[engine.rank])
            if cmd.publish:
                publish_tensors(engine, self.cfg, torch.float32)  # take part in the gather; rank 0 writes
            if cmd.checkpoint:
                self.checkpoints.save_shards(cmd.step)
            if cmd.stop:
                return not cmd.failed


def _write_json(path: Path, data: dict) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically (a reader sees the old file or the new)."""
    write_atomic(path, json.dumps(data, indent=1) + "\n")


async def close_run(redis, keys, reason: str, ledger_path: Path, steps: int | None = None) -> int:
    """The run ended: end the groups left in its streams (``dropped`` with ``reason`` in the ledger)
    and export the ledger to ``ledger_path``. Idempotent. Returns how many groups it ended.
    ``steps``: a finished run's step count, recorded so the audit can check that each step trained."""
    from broker import Stream
    from broker.ledger import Ledger

    ended = 0
    for stream in (Stream.prompts(redis, keys), Stream.trajectories(redis, keys)):
        ended += await stream.close(reason)
    ledger = Ledger(redis, keys)
    await ledger.append("closed", reason=reason, ended=ended, **({} if steps is None else {"steps": steps}))
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    entries = await ledger.export(ledger_path)
    log.info("run %s ended (%s): %d groups left ended, %d ledger entries in %s",
             keys.run_id, reason, ended, entries, ledger_path)
    return ended
