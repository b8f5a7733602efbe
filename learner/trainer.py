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
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.config import RunConfig
from services.settings import ServiceSettings

log = logging.getLogger("tandem.learner")


@dataclass
class Status:
    """What ``GET /v1/status`` shows; written by the training thread, read by the HTTP thread."""

    state: str = "starting"  # starting | waiting | training | done | failed | stopped
    step: int = 0
    steps: int = 0
    version: int = 0
    rank_count: int = 1
    error: str | None = None
    last: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    tokens_per_s: float = 0.0
    idle_fraction: float = 0.0
    last_publish: dict = field(default_factory=dict)
    resumed_from: int | None = None
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Paths:
    """Where one run's learner files live."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        base = Path(run_dir) / run_id
        self.weights = base / "weights"
        self.checkpoints = base / "checkpoints"
        self.logs = base / "learner"


def run_id_of(settings: ServiceSettings, cfg: RunConfig) -> str:
    return settings.run_id or cfg.name


class Trainer:
    """Runs the loop above on every rank; rank 0 also owns Redis, metrics and status."""

    def __init__(self, settings: ServiceSettings, cfg: RunConfig, metrics=None) -> None:
        self.settings = settings
        self.cfg = cfg
        self.run_id = run_id_of(settings, cfg)
        self.paths = Paths(settings.run_dir, self.run_id)
        self.status = Status(steps=cfg.learner.steps)
        self.metrics = metrics
        self.stop_event = threading.Event()

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
        step = state["step"] if state else 0
        version = state["version"] if state else 0
        self.status.resumed_from = step if state else None
        if engine.rank == 0:
            try:
                await self._run_rank0(engine, state, step, version)
            except Exception:
                # release the other ranks (they wait in a broadcast); a failure inside a
                # collective cannot be helped, but a data timeout or a broker error can
                self._command({"op": "stop", "failed": True})
                raise
        elif not self._run_follower(engine, step, version):
            raise RuntimeError("rank 0 failed; see its log")
        torch.distributed.barrier()

    # -- rank 0 -------------------------------------------------------------

    async def _run_rank0(self, engine, state: dict | None, step: int, version: int) -> None:
        from broker import Keys, WeightRegistry, connect
        from learner import weights as store
        from learner.batch import build_batch, split_ranks
        from learner.feeder import Feeder

        cfg = self.cfg
        if not self.settings.redis_url:
            raise RuntimeError("the learner needs a Redis URL (TANDEM_REDIS_URL or REDIS_URL)")
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        store.clean_temp(self.paths.weights)
        redis = connect(self.settings.redis_url)
        try:
            keys = Keys(self.run_id)
            registry = WeightRegistry(redis, keys)
            feeder = Feeder(
                redis, keys, cfg, vocab_size=engine.vocab_size, max_len=engine.max_len,
                consumer=f"learner-{self.settings.name}",
            )
            self.feeder, self.registry, self.keys, self.redis = feeder, registry, keys, redis
            await feeder.stream.ensure_group()
            if state and state.get("unacked"):
                # trained into the checkpointed weights: done before anything is taken over
                await feeder.stream.ack(_deliveries(state["unacked"]))  # no counter: may be counted already
            await feeder.start()
            latest = await registry.latest()
            registered = latest.version if latest else 0
            if registered < version:
                raise RuntimeError(
                    f"the registry's latest version is {registered} but the checkpoint holds {version}: "
                    "the broker lost data (is Redis persistent?)"
                )
            if registered > version:
                log.warning(
                    "versions %d..%d were published after the last checkpoint (step %d); "
                    "publishing the resumed weights as version %d", version + 1, registered, step, registered + 1,
                )
                self._command({"op": "publish"})
                version = await self._publish(engine, registry, registered + 1, step, resume=True)
            self.status.step, self.status.version = step, version
            await self._write_state(step, version)

            saved_step = step
            t_start = time.monotonic()
            idle_start = feeder.idle_s
            tokens_total = 0.0
            while step < cfg.learner.steps and not self.stop_event.is_set():
                self.status.state = "waiting"
                batch = await feeder.next_batch(
                    version, cfg.learner.groups_per_step, cfg.learner.wait_timeout_s, stop=self.stop_event
                )
                if batch is None:
                    break
                deliveries = [d for d, _ in batch]
                lags = [version - g.policy_version for _, g in batch]  # v_learner - v, all <= eta
                seqs = build_batch([g for _, g in batch], cfg.loss, cfg.sampling.max_tokens)
                if not seqs:  # every completion was overlong-filtered or empty
                    await feeder.stream.ack(deliveries, counter="empty_dropped")
                    continue
                self.status.state = "training"
                publish = (step + 1) % cfg.publish.every == 0
                last = step + 1 >= cfg.learner.steps
                ckpt = last or (cfg.learner.checkpoint_every > 0 and (step + 1) % cfg.learner.checkpoint_every == 0)
                shares = split_ranks(seqs, engine.world)
                self._command({"op": "step", "shares": shares, "publish": publish, "checkpoint": ckpt})
                t0 = time.monotonic()
                stats = engine.train_step(shares[0])
                step += 1
                train_s = time.monotonic() - t0
                if publish:
                    version = await self._publish(engine, registry, version + 1, step, resume=False)
                if ckpt:
                    unacked = [[d.entry_id.decode(), d.envelope.group_id] for d in deliveries]
                    engine.save(self.paths.checkpoints, f"step{step:08d}", {"step": step, "version": version, "unacked": unacked})
                    saved_step = step
                await feeder.ack_trained(deliveries)
                tokens = sum(s.length for s in seqs)
                tokens_total += tokens
                wall = time.monotonic() - t_start
                self.status.step, self.status.version = step, version
                self.status.last = stats | {"train_s": train_s, "groups": len(batch), "sequences": len(seqs)}
                self.status.tokens_per_s = tokens / max(train_s, 1e-9)
                self.status.idle_fraction = (feeder.idle_s - idle_start) / max(wall, 1e-9)
                self.status.counts = dict(feeder.counts)
                self._audit("trained.jsonl", {
                    "step": step, "version": version, "pid": os.getpid(),
                    "groups": [g.group_id for _, g in batch], "group_versions": [g.policy_version for _, g in batch],
                })
                rewards = [smp.reward for _, g in batch for smp in g.samples]
                point = {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and math.isfinite(v)} | {
                    "reward_mean": sum(rewards) / len(rewards),
                    "lag_max": float(max(lags)), "lag_mean": sum(lags) / len(lags),
                    "stale_dropped": float(feeder.counts["stale_dropped"]),
                    "learner_tokens_per_s": self.status.tokens_per_s,
                    "learner_idle_frac": self.status.idle_fraction,
                }
                await self._write_state(step, version, point)
                if self.metrics is not None:
                    self.metrics.observe_step(self.status, tokens)
                log.info(
                    "step %d v%d loss %.4f kl %.4f entropy %.3f clip %.3f tokens/s %.0f idle %.2f",
                    step, version, stats["loss"], stats["kl"], stats["entropy"], stats["clip_fraction"],
                    self.status.tokens_per_s, self.status.idle_fraction,
                )
            if step > saved_step and step < cfg.learner.steps:
                # stopped on request (SIGTERM): keep the progress; every trained group is acked already
                self._command({"op": "save", "step": step})
                engine.save(self.paths.checkpoints, f"step{step:08d}", {"step": step, "version": version, "unacked": []})
            self._command({"op": "stop"})
            self.status.state = "done" if step >= cfg.learner.steps else "stopped"
            await self._write_state(step, version)
        finally:
            await redis.aclose()

    async def _publish(self, engine, registry, version: int, step: int, *, resume: bool) -> int:
        """Gather (collective), write and register ``version``; prune old versions. Returns ``version``."""
        import torch

        from broker import WeightVersion
        from learner import weights as store

        dtype = getattr(torch, self.cfg.model.dtype)
        t0 = time.perf_counter()
        tensors, layout = publish_tensors(engine, self.cfg, dtype)
        gather_s = time.perf_counter() - t0
        written = store.write_version(self.paths.weights, version, tensors, step=step, replace=True, **layout)
        await registry.publish(
            WeightVersion(version=version, uri=str(written.path.resolve()), sha256=written.sha256,
                          created_at=time.time(), bytes=written.bytes)
        )
        total_s = time.perf_counter() - t0
        info = {
            "version": version, "step": step, "bytes": written.bytes, "gather_s": gather_s,
            "write_s": written.seconds, "total_s": total_s, "write_gb_per_s": written.gb_per_s, "resume": resume,
        }
        self.status.last_publish = info
        self._audit("published.jsonl", info)
        print(
            f"published v{version} (step {step}): {written.bytes / 1e6:.1f} MB in {total_s:.3f} s "
            f"(gather {gather_s:.3f} s, write {written.seconds:.3f} s = {written.gb_per_s:.2f} GB/s)",
            flush=True,
        )
        if self.metrics is not None:
            self.metrics.observe_publish(info)
        await self._prune(registry)
        return version

    async def _prune(self, registry) -> None:
        from learner import weights as store

        history = [w.version for w in await registry.history()]
        in_use = (await registry.in_use()).values()
        _keep, delete = store.retained(history, self.cfg.publish.keep, in_use)
        for v in sorted(delete):
            path = store.version_dir(self.paths.weights, v)
            if path.exists():
                store.delete_version(self.paths.weights, v)
        await registry.forget(sorted(delete))

    async def _write_state(self, step: int, version: int, point: dict | None = None) -> None:
        """Progress into the run registry (when the control plane knows the run) and the metrics log."""
        from services.runs import MetricsLog, RunStore, UnknownRun

        try:
            await RunStore(self.redis).update(self.run_id, step=step, policy_version=version)
        except UnknownRun:
            pass  # a run started without the control plane (tandem serve learner with TANDEM_RUN_ID)
        if point:
            await MetricsLog(self.redis, self.keys).append("learner", step, **point)

    def _audit(self, name: str, record: dict) -> None:
        with open(self.paths.logs / name, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def _command(self, cmd: dict) -> None:
        """Tell the other ranks what to do next (no-op on one rank)."""
        import torch

        if self.engine.world > 1:
            torch.distributed.broadcast_object_list([cmd], src=0)

    # -- ranks > 0 ------------------------------------------------------------

    def _run_follower(self, engine, step: int, version: int) -> bool:
        """Follow rank 0's commands until it says stop; False if it stopped because it failed."""
        import torch

        while True:
            box = [None]
            torch.distributed.broadcast_object_list(box, src=0)
            cmd = box[0]
            if cmd["op"] == "stop":
                return not cmd.get("failed", False)
            if cmd["op"] == "publish":
                self._gather(engine)  # take part in the gather; rank 0 writes
                continue
            if cmd["op"] == "save":
                engine.save(self.paths.checkpoints, f"step{cmd['step']:08d}", {})
                continue
            engine.train_step(cmd["shares"][engine.rank])
            step += 1
            if cmd["publish"]:
                self._gather(engine)
            if cmd["checkpoint"]:
                engine.save(self.paths.checkpoints, f"step{step:08d}", {})

    def _gather(self, engine) -> None:
        """A follower's part of a publish: the same collective gathers rank 0 runs."""
        import torch

        publish_tensors(engine, self.cfg, torch.float32)


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
