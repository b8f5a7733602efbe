"""Publishing: the learner's side of the weight path, from the engine's weights to the registry.

Who talks to whom: rank 0's trainer (``learner.trainer``) calls :meth:`Publisher.publish` every
``publish.every`` steps (and once at a resume that retracted versions); the publisher reads the
weights from ``learner.engine``, streams them to the rollout servers (``broker.broadcast``,
``services.weightgroup``), writes them to the weight store (``services.weightstore``) and registers
them with the broker (``broker.weight_versions``), whose rollout servers load them from there
(``rollout_server/transports.py``). A version, in order:

1. **gather** (:func:`publish_tensors`; collective, every rank takes part and rank 0 gets the
   tensors): the full weights in Hugging Face naming (``LearnerEngine.full_state_dict``: ZeRO-3
   gathered module by module, LoRA merged in, tied ``lm_head`` left out) in ``model.dtype``, or with
   ``publish.lora_format = "adapter"`` only the adapter in PEFT's layout;
2. **broadcast** (``publish.transport = "broadcast"``, :class:`Broadcaster`): the rollout servers that
   :meth:`joined <broker.broadcast.BroadcastBoard.join>` the board are seated, the group is announced
   through Redis and the tensors streamed to them in memory; adapters are never broadcast (the config
   refuses it);
3. **write** (``services.weightstore.write_version``): the version's directory, atomically
   (safetensors, sha256, ``tandem-version.json``), committed when the run directory is a Modal
   volume, so resume, export and any server the broadcast left out have it;
4. **register** (``WeightRegistry.publish``: uri, sha256, bytes): rollout servers see it from now on;
5. **record and prune**: ``published.jsonl``, ``/v1/status``, Prometheus; then retention
   (``learner.retention``) names the versions to delete, from disk and from the registry, and the
   decision is written to ``<run>/weights/retention.json``.

With the broadcast, 3-5 run in the background (the write in a thread of its own) while the learner
trains its next step: :meth:`Publisher.written` waits for them before the next publish's gather (the
gather refills the host buffers that write reads on a GPU, and the registry stays in order), and
before a checkpoint, which must find its version registered at a resume. With files, the learner
waits for all five.

A broadcast's failure never stops the learner: with no member, nothing is sent; a member that never
joins or stops answering costs at most ``publish.broadcast_timeout_s`` per wait, then the broadcast
is abandoned, its members are dropped from the board (they join again with their next heartbeat, and
meanwhile load the version's files) and the ledger records why. The ledger's ``broadcast`` event
(version, members) comes before the announcement, ``broadcast_sent`` (digest or error, seconds)
after the send.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from broker.broadcast import Announcement, BroadcastBoard, seat
from broker.keys import Keys
from broker.ledger import Ledger
from host.files import write_atomic
from learner.retention import RETENTION_FILE, best, retained
from learner.status import Published
from services.config import PublishConfig, RunConfig

if TYPE_CHECKING:
    from broker import WeightRegistry
    from learner.engine import LearnerEngine
    from learner.settings import LearnerSettings
    from learner.status import Status
    from services.timeline import Timeline

log = logging.getLogger("tandem.learner")


def publish_tensors(engine: LearnerEngine, cfg: RunConfig, dtype) -> tuple[dict, dict]:
    """What a publish writes: (tensors, ``write_version`` layout arguments). Collective.

    Full weights (LoRA merged in) by default; with ``publish.lora_format =
    "adapter"`` only the adapter, in PEFT's file layout.
    """
    if engine.lora and cfg.publish.lora_format == "adapter":
        tensors, adapter_config = engine.adapter_state_dict(dtype)
        return tensors, {"weights_name": "adapter_model.safetensors",
                         "extra_files": {"adapter_config.json": adapter_config}}
    return engine.full_state_dict(dtype), {}


@dataclass(frozen=True)
class Sent:
    """One version's broadcast: its digest (None when it failed), members and seconds."""

    version: int
    members: list[str]
    seconds: float
    digest: str | None
    error: str | None = None


class Broadcaster:
    """Rank 0's half of ``publish.transport = "broadcast"``: announce a version's group and stream it."""

    def __init__(self, redis, keys: Keys, publish: PublishConfig, host: str, key: bytes) -> None:
        self.board = BroadcastBoard(redis, keys)
        self.ledger = Ledger(redis, keys)
        self.publish = publish
        self.host = host
        self.key = key
        """Signs each group's store (``services.weightgroup.broadcast_key``): only holders of the token join."""

    async def send(self, version: int, tensors: dict) -> Sent | None:
        """Stream ``version`` to the members now on the board; None when there is none."""
        from services.weightgroup import BroadcastFailed, WeightGroup

        seats, world = seat(await self.board.members())
        if not seats:
            return None
        t0, timeout = time.perf_counter(), self.publish.broadcast_timeout_s
        name = f"v{version}-{secrets.token_hex(4)}"  # signatures bind it: none carries over from another group
        digest = error = None
        try:
            group = await asyncio.to_thread(WeightGroup, self.host, 0, 0, world, key=self.key, timeout_s=timeout,
                                            name=name)
            # in the ledger first: a server may hold the version before anything else is recorded
            await self.ledger.append("broadcast", version=version, members=sorted(seats))
            await self.board.announce(Announcement(version=version, host=self.host, port=group.port, group=name,
                                                   world=world, seats=seats, timeout_s=timeout,
                                                   created_at=time.time()))
            digest = await asyncio.to_thread(group.send, tensors)
        except BroadcastFailed as e:
            error = str(e)
            await self.board.drop(*seats)
            log.warning("broadcast of v%d to %s abandoned (%s); they load its files", version, sorted(seats), e)
        sent = Sent(version, sorted(seats), time.perf_counter() - t0, digest, error)
        await self.ledger.append("broadcast_sent", version=version, members=sent.members, digest=digest,
                                 seconds=round(sent.seconds, 4), **({"error": error} if error else {}))
        return sent


class Publisher:
    """Rank 0's publishing of one run's versions (steps 1-5 above); the trainer decides their numbers."""

    def __init__(self, engine: LearnerEngine, cfg: RunConfig, settings: LearnerSettings, redis, keys: Keys,
                 registry: WeightRegistry, *, weights: Path, published_log: Path, status: Status, metrics,
                 timeline: Timeline) -> None:
        self.engine, self.cfg = engine, cfg
        self.redis, self.keys, self.registry = redis, keys, registry
        self.weights = weights
        """The run's weight store (``<run>/weights``)."""
        self.published_log = published_log
        """``published.jsonl``: a line per version this process published (a ``learner.status.Published``)."""
        self.volume = settings.run_dir_volume
        self.status, self.metrics, self.timeline = status, metrics, timeline
        self.broadcaster = None
        """With ``publish.transport = "broadcast"``: streams each version before its files are written."""
        if cfg.publish.transport == "broadcast" and settings.broadcast_host:
            from services.weightgroup import broadcast_key

            self.broadcaster = Broadcaster(redis, keys, cfg.publish, settings.broadcast_host,
                                           broadcast_key(settings.token))
        elif cfg.publish.transport == "broadcast":
            log.warning("publish.transport = 'broadcast', but this learner has no address the rollout servers "
                        "reach (TANDEM_LEARNER_BROADCAST_HOST is empty): versions go as files")
        self._writing: asyncio.Task | None = None
        """The background write and registration of the last broadcast version (:meth:`publish`)."""

    async def publish(self, version: int, step: int, *, resume: bool) -> None:
        """Gather (collective), write and register ``version``, the weights of ``step``; prune old versions.

        With ``publish.transport = "broadcast"`` the version is streamed to the servers in its group first
        and its files are written and registered in the background (:meth:`written` waits for them: before
        the next publish's gather, which may refill the buffers it reads, so a version's files hold its own
        weights and the registry stays in order, and before a checkpoint, which must find its version
        registered at a resume): the learner's next step does not wait for the disk."""
        import torch

        dtype = getattr(torch, self.cfg.model.dtype)
        t0 = time.perf_counter()
        # before the gather: on a GPU it refills the host buffers the previous version's files are written
        # from (LearnerEngine._to_host), which would write this version's bytes under that version's name
        await self.written()
        tensors, layout = publish_tensors(self.engine, self.cfg, dtype)
        gather_s = time.perf_counter() - t0
        if self.broadcaster is None or layout:  # files (adapters are never broadcast: the config refuses it)
            await self._write(version, step, tensors, layout, resume=resume, t0=t0, gather_s=gather_s, sent=None)
            return
        with self.timeline.span("broadcast", "rank0", step=step, version=version):
            sent = await self.broadcaster.send(version, tensors)
        if self.engine.zero_stage != 3:  # unsharded tensors may be the live parameters the next step changes
            tensors = {k: t.clone() for k, t in tensors.items()}
        self._writing = asyncio.create_task(
            self._write(version, step, tensors, layout, resume=resume, t0=t0, gather_s=gather_s, sent=sent,
                        blocked_s=time.perf_counter() - t0),
            name=f"write-v{version}")

    async def written(self) -> None:
        """Wait for the background write of the last broadcast version (its failure is raised here)."""
        if self._writing is not None:
            task, self._writing = self._writing, None
            await task

    async def abandon(self) -> None:
        """The learner is failing: stop the background write (a half-written version is cleaned at the next start)."""
        if self._writing is not None:
            self._writing.cancel()
            await asyncio.gather(self._writing, return_exceptions=True)

    async def announced(self) -> int:
        """The newest version a broadcast announced (0: none), whether or not its files were registered."""
        a = await BroadcastBoard(self.redis, self.keys).latest()
        return 0 if a is None else a.version

    async def _write(self, version: int, step: int, tensors: dict, layout: dict, *, resume: bool, t0: float,
                     gather_s: float, sent: Sent | None, blocked_s: float | None = None) -> None:
        """Write and register ``version`` (the weights of ``step``), record it, prune. ``blocked_s``: set when it runs in the background
        (the learner was blocked that long: gather + broadcast), the write then in a thread of its own."""
        from broker import WeightVersion
        from services import weightstore as store

        def write():
            return store.write_version(self.weights, version, tensors, step=step, replace=True, **layout)

        written = await asyncio.to_thread(write) if blocked_s is not None else write()
        if self.volume:  # other containers see the version only once committed
            await asyncio.to_thread(store.commit_volume, self.volume)
        await self.registry.publish(
            WeightVersion(version=version, uri=str(written.path.resolve()), sha256=written.sha256,
                          created_at=time.time(), bytes=written.bytes),
            step=step,
        )
        info = Published(
            version=version, step=step, bytes=written.bytes, gather_s=gather_s, write_s=written.seconds,
            total_s=time.perf_counter() - t0, write_gb_per_s=written.gb_per_s, resume=resume,
            broadcast_s=None if sent is None else sent.seconds,
            broadcast_to=0 if sent is None or sent.digest is None else len(sent.members),
            blocked_s=time.perf_counter() - t0 if blocked_s is None else blocked_s,
        )
        self.status.last_publish = info
        with open(self.published_log, "a") as f:
            f.write(json.dumps(info.model_dump()) + "\n")
            f.flush()
        log.info(
            "published v%d (step %d): %.1f MB in %.3f s (gather %.3f s, write %.3f s = %.2f GB/s; learner blocked "
            "%.3f s)", version, step, written.bytes / 1e6, info.total_s, gather_s, written.seconds,
            written.gb_per_s, info.blocked_s,
        )
        if self.metrics is not None:
            self.metrics.observe_publish(info)
        await self._prune()

    async def _prune(self) -> None:
        """Delete the versions retention no longer keeps, from disk and from the registry."""
        from services import weightstore as store

        history = [w.version for w in await self.registry.history()]
        in_use = (await self.registry.in_use()).values()
        pub, scores = self.cfg.publish, {}
        if pub.keep_best:
            from services.evaluate import EvalLog, due

            scores = {v: p.accuracy for v, p in (await EvalLog(self.redis, self.keys).points()).items()}
        keep, delete = retained(history, pub.keep, in_use, keep_every=pub.keep_every, keep_best=pub.keep_best,
                                scores=scores, due=lambda v: due(v, self.cfg.eval))
        for v in sorted(delete):
            path = store.version_dir(self.weights, v)
            if path.exists():
                store.delete_version(self.weights, v)
        await self.registry.forget(sorted(delete))
        write_atomic(self.weights / RETENTION_FILE, json.dumps({  # a reader sees the old file or the new
            "scores": {str(v): s for v, s in sorted(scores.items())}, "kept": sorted(keep),
            "best": best(scores, pub.keep_best, among=keep),
        }, indent=1) + "\n")
