"""The learner's training loop: broker -> DeepSpeed step -> publish -> checkpoint -> ack.

Rank 0 talks to Redis (the :class:`~learner.feeder.Feeder` and the weight
registry) and tells the other ranks what to do with one broadcast per step
(their rows of the batch, whether to publish, checkpoint or stop); every
rank runs the collective parts (forward/backward, ZeRO-3 gathers,
checkpoint saves).

One step, in this order:

1. form the batch for ``v_learner + 1`` (acceptance judged now; stale groups
   acknowledged as ``stale_dropped``);
2. train one optimizer step on it;
3. every ``publish.every`` steps: gather the full weights, write version
   ``v_learner + 1`` atomically, register it, prune old versions;
4. every ``learner.checkpoint_every`` steps, after the last, and when stopped
   on request (SIGTERM; not after kill -9, of course): save a
   checkpoint holding the step, ``v_learner``, each rank's RNG state, and the
   broker position: the entry ids of this step's groups, not yet acknowledged;
5. acknowledge this step's groups (``accepted``): they become *done*.

Resume and idempotency (kill -9 at any point, restart):

- The checkpoint named by the pointer file is loaded: weights, optimizer,
  LR schedule, RNG, step, ``v_learner``. Groups whose acknowledgement the
  checkpoint recorded as outstanding are acknowledged now (idempotent), so a
  group trained into the checkpointed weights is never trained again.
- Groups trained *after* the checkpoint were either acknowledged (done: the
  broker never delivers them again, so they are lost from the weights but
  never trained twice) or not (still pending: taken over at start-up and
  trained once in the resumed lineage). Entries pending for the dead learner
  are claimed at once (``Feeder.start``).
- Versions: let ``V`` be the checkpoint's ``v_learner`` and ``L`` the registry's
  latest. Publishing happens before the checkpoint of the same step, so
  ``L >= V``. If ``L == V``, numbering continues at ``V + 1``. If ``L > V``
  (versions published after the checkpoint), those versions came from
  weights the resumed learner no longer has: it publishes its own weights at
  once as version ``L + 1`` and continues from there. The sequence has no gap
  and no repeat (the registry refuses both), and the acceptance rule is
  judged against weights the learner really holds: with ``eta = 0`` groups
  from the abandoned versions ``V+1..L`` are dropped as stale, so every
  group used is still exactly on-policy.
- A version directory written but never registered (kill between write and
  register) is overwritten when that number is published; half-written temp
  directories are removed at start-up.

Audit logs (``<run_dir>/<run_id>/learner/``): ``trained.jsonl`` (a line per
step, after its acknowledgement: step, version, group ids, pid) and
``published.jsonl``; the resume test reads them.

In the code, rank 0's run is :meth:`Trainer._lead`: ``_resume`` once, then
per step ``_feed`` (1), ``_plan`` and ``_step`` (2), ``_publish`` (3),
``_checkpoint`` (4), the acknowledgement (5) and ``_report`` (status,
metrics, audit log, run registry); ``_finish`` at the end. What rank 0
tells the other ranks is a :class:`~learner.ranks.RankCommand`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from learner.ranks import RankChannel, RankCommand, receive
from learner.settings import LearnerSettings
from learner.status import Published, Status
from learner.weights import retained
from services.config import RunConfig

if TYPE_CHECKING:
    from broker import Delivery
    from learner.batch import TrainSeq
    from services.wire import TrajectoryGroup

log = logging.getLogger("tandem.learner")


class Paths:
    """Where one run's learner files live."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        base = Path(run_dir) / run_id
        self.weights = base / "weights"
        self.checkpoints = base / "checkpoints"
        self.logs = base / "learner"


def run_id_of(settings: LearnerSettings, cfg: RunConfig) -> str:
    return settings.run_id or cfg.name


def checkpoint_tag(step: int) -> str:
    """The name of the checkpoint saved after ``step`` steps (every rank saves under it)."""
    return f"step{step:08d}"


@dataclass(frozen=True)
class Batch:
    """One step's groups as the feeder handed them out (oldest first) and the rows built from them."""

    taken: list[tuple[Delivery, TrajectoryGroup]]
    seqs: list[TrainSeq]
    lags: list[int]
    """``v_learner - v`` of each group when the batch was formed: all within ``max_staleness``."""

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

        from learner.engine import Engine

        engine = Engine(self.cfg)
        self.engine = engine
        self.status.rank_count = engine.world
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
                # collective cannot be helped, but a data timeout or a broker error can
                if not self.ranks.stopped:
                    self.ranks.send(RankCommand(step=self.step, stop=True, failed=True))
                raise
        elif not self._follow():
            raise RuntimeError("rank 0 failed; see its log")
        torch.distributed.barrier()

    # -- rank 0 -------------------------------------------------------------

    async def _lead(self, state: dict | None) -> None:
        """Rank 0's run: resume, then feed -> step -> publish -> checkpoint -> ack -> report."""
        from broker import Keys, WeightRegistry, connect
        from learner.feeder import Feeder
        from services import weightstore as store

        if not self.settings.redis_url:
            raise RuntimeError("the learner needs a Redis URL (REDIS_URL)")
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        store.clean_temp(self.paths.weights)
        self.redis = connect(self.settings.redis_url)
        try:
            self.keys = Keys(self.run_id)
            self.registry = WeightRegistry(self.redis, self.keys)
            self.feeder = Feeder(
                self.redis, self.keys, self.cfg, vocab_size=self.engine.vocab_size, max_len=self.engine.max_len,
                consumer=f"learner-{self.settings.name}",
            )
            await self._resume(state)
            self._t_start, self._idle_start = time.monotonic(), self.feeder.idle_s
            while self.step < self.cfg.learner.steps and not self.stop_event.is_set():
                batch = await self._feed()
                if batch is None:
                    break
                cmd = self._plan(batch)
                stats, train_s = self._step(cmd)
                if cmd.publish:
                    await self._publish(self.version + 1, resume=False)
                if cmd.checkpoint:
                    self._checkpoint(batch.deliveries)
                await self.feeder.ack_trained(batch.deliveries)
                await self._report(batch, stats, train_s)
            await self._finish()
        finally:
            await self.redis.aclose()

    async def _resume(self, state: dict | None) -> None:
        """Pick up where the checkpoint left off ("Resume and idempotency" above)."""
        feeder = self.feeder
        await feeder.stream.ensure_group()
        if state and state.get("unacked"):
            # trained into the checkpointed weights: done before anything is taken over
            await feeder.stream.ack(_deliveries(state["unacked"]))  # no counter: may be counted already
        await feeder.start()
        latest = await self.registry.latest()
        registered = latest.version if latest else 0
        if registered < self.version:
            raise RuntimeError(
                f"the registry's latest version is {registered} but the checkpoint holds {self.version}: "
                "the broker lost data (is Redis persistent?)"
            )
        if registered > self.version:
            log.warning(
                "versions %d..%d were published after the last checkpoint (step %d); "
                "publishing the resumed weights as version %d", self.version + 1, registered, self.step, registered + 1,
            )
            self.ranks.send(RankCommand(step=self.step, publish=True))
            await self._publish(registered + 1, resume=True)
        self.saved_step = self.step
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
            taken = await self.feeder.next_batch(
                self.version, cfg.learner.groups_per_step, cfg.learner.wait_timeout_s, stop=self.stop_event
            )
            if taken is None:
                return None
            seqs = build_batch([g for _, g in taken], cfg.loss, cfg.sampling.max_tokens)
            if seqs:
                return Batch(taken, seqs, lags=[self.version - g.policy_version for _, g in taken])
            # every completion was overlong-filtered or empty
            await self.feeder.stream.ack([d for d, _ in taken], counter="empty_dropped")

    def _plan(self, batch: Batch) -> RankCommand:
        """What the step that trains ``batch`` does: every rank's rows, and whether it publishes and checkpoints."""
        from learner.batch import split_ranks

        cfg = self.cfg.learner
        step = self.step + 1
        return RankCommand(
            step=step,
            rows=split_ranks(batch.seqs, self.engine.world),
            publish=step % self.cfg.publish.every == 0,
            checkpoint=step >= cfg.steps or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0),
        )

    def _step(self, cmd: RankCommand) -> tuple[dict[str, float], float]:
        """Tell the other ranks, then train this rank's rows (collective). Returns (stats, seconds)."""
        self.status.state = "training"
        self.ranks.send(cmd)
        t0 = time.monotonic()
        stats = self.engine.train_step(cmd.rows[0])
        self.step = cmd.step
        return stats, time.monotonic() - t0

    async def _publish(self, version: int, *, resume: bool) -> None:
        """Gather (collective), write and register ``version``; prune old versions. It becomes v_learner."""
        import torch

        from broker import WeightVersion
        from services import weightstore as store

        dtype = getattr(torch, self.cfg.model.dtype)
        t0 = time.perf_counter()
        tensors, layout = publish_tensors(self.engine, self.cfg, dtype)
        gather_s = time.perf_counter() - t0
        written = store.write_version(self.paths.weights, version, tensors, step=self.step, replace=True, **layout)
        if self.settings.run_dir_volume:  # other containers see the version only once committed
            await asyncio.to_thread(store.commit_volume, self.settings.run_dir_volume)
        await self.registry.publish(
            WeightVersion(version=version, uri=str(written.path.resolve()), sha256=written.sha256,
                          created_at=time.time(), bytes=written.bytes)
        )
        self.version = version
        info = Published(
            version=version, step=self.step, bytes=written.bytes, gather_s=gather_s, write_s=written.seconds,
            total_s=time.perf_counter() - t0, write_gb_per_s=written.gb_per_s, resume=resume,
        )
        self.status.last_publish = info
        self._audit("published.jsonl", info.model_dump())
        log.info(
            "published v%d (step %d): %.1f MB in %.3f s (gather %.3f s, write %.3f s = %.2f GB/s)",
            version, self.step, written.bytes / 1e6, info.total_s, gather_s, written.seconds, written.gb_per_s,
        )
        if self.metrics is not None:
            self.metrics.observe_publish(info)
        await self._prune()

    async def _prune(self) -> None:
        """Delete the versions retention no longer keeps, from disk and from the registry."""
        from services import weightstore as store

        history = [w.version for w in await self.registry.history()]
        in_use = (await self.registry.in_use()).values()
        _keep, delete = retained(history, self.cfg.publish.keep, in_use)
        for v in sorted(delete):
            path = store.version_dir(self.paths.weights, v)
            if path.exists():
                store.delete_version(self.paths.weights, v)
        await self.registry.forget(sorted(delete))

    def _checkpoint(self, unacked: list[Delivery]) -> None:
        """Save this step's checkpoint (collective), recording the groups it trained but did not yet acknowledge."""
        state = {
            "step": self.step, "version": self.version,
            "unacked": [[d.entry_id.decode(), d.envelope.group_id] for d in unacked],
        }
        self.engine.save(self.paths.checkpoints, checkpoint_tag(self.step), state)
        self.saved_step = self.step

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
            "learner_tokens_per_s": st.tokens_per_s,
            "learner_idle_frac": st.idle_fraction,
        }
        await self._write_state(point)
        if self.metrics is not None:
            self.metrics.observe_step(st, tokens)
        log.info(
            "step %d v%d loss %.4f kl %.4f entropy %.3f clip %.3f tokens/s %.0f idle %.2f",
            self.step, self.version, stats["loss"], stats["kl"], stats["entropy"], stats["clip_fraction"],
            st.tokens_per_s, st.idle_fraction,
        )

    async def _finish(self) -> None:
        """The loop ended (last step, or stopped): keep the progress, release the other ranks, report."""
        if self.saved_step < self.step < self.cfg.learner.steps:
            # stopped on request (SIGTERM): keep the progress; every trained group is acked already
            self.ranks.send(RankCommand(step=self.step, checkpoint=True))
            self._checkpoint([])
        self.ranks.send(RankCommand(step=self.step, stop=True))
        self.status.state = "done" if self.step >= self.cfg.learner.steps else "stopped"
        await self._write_state()

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
                engine.save(self.paths.checkpoints, checkpoint_tag(cmd.step), {})
            if cmd.stop:
                return not cmd.failed


def publish_tensors(engine, cfg: RunConfig, dtype) -> tuple[dict, dict]:
    """What a publish writes: (tensors, ``write_version`` layout arguments). Collective.

    Full weights (LoRA merged in) by default; with ``publish.lora_format =
    "adapter"`` only the adapter, in PEFT's file layout.
    """
    if engine.lora and cfg.publish.lora_format == "adapter":
        tensors, adapter_config = engine.adapter_state_dict(dtype)
        return tensors, {"weights_name": "adapter_model.safetensors",
                         "extra_files": {"adapter_config.json": adapter_config}}
    return engine.full_state_dict(dtype), {}


def _deliveries(pairs: list[list[str]]):
    """Delivery handles of entries recorded in a checkpoint (for acknowledging them)."""
    from broker import Delivery, Envelope

    return [Delivery(entry_id.encode(), Envelope(gid, -1, b""), 1) for entry_id, gid in pairs]
