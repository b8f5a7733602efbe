"""Weight reloads: a published version, from its arrival at the rollout server to the engine serving it.

**Where a version arrives.** Every caller asks :meth:`WeightReloads.load_weights` with a
:class:`~services.wire.LoadWeights` (version, URI, sha256) and nothing else:

- the actor (``actor.Actor``): its registry watcher loads each version the learner registers,
  admission's ``stale`` answer loads the newest one, and under ``publish.transport = "broadcast"``
  its board member loads the ``broadcast://`` seat the learner announces (ledger ``received``);
- ``POST /v1/weights`` (``api``), the path confined to the weight store first (``transports.confine``);
- a new run in stack mode (``follower``) goes back to the model directory's weights
  (:meth:`WeightReloads.reset_to_base`).

**What a reload does**, under one lock, so that concurrent callers load each version once:

1. A version not newer than the served one is a no-op.
2. The transport is picked by URI scheme (``transports``: files, broadcast; ``adapters`` on an
   engine that serves LoRA adapters); its ``prepare`` runs while the engine keeps generating
   (a Modal Volume reloaded first): it reads and checksums the files or the learner's manifest
   and checks that they fit the model. A bad version is refused
   (:class:`~rollout_server.transports.WeightLoadError`), the engine untouched.
3. :meth:`WeightReloads._apply` pauses vLLM, has the transport ``apply`` the weights, registers
   the version's label and resumes (below); a load that fails half way puts the previous version
   back (:meth:`WeightReloads._restore`).
4. The caller's ``record`` (the actor's ledger entry and in-use report) runs in the same task,
   still under the lock.

**Weight reloads and requests in flight.** :meth:`WeightReloads.load_weights`
verifies the new version first (engine untouched), then pauses the
scheduler in vLLM's ``"wait"`` mode: requests already in the engine *finish
on the old weights and are tagged with the old version*; requests arriving
meanwhile queue inside vLLM and start on the new weights once generation
resumes. The prefix cache is cleared during the pause (vLLM's
``clear_cache``), so no KV computed by old weights is reused. The weights are
then reloaded in place (``collective_rpc("reload_weights")``) and the new
version is registered as vLLM's weight-version label. A drain therefore
costs at most the time to finish the longest request in flight.

With the run's ``publish.reload = "keep"`` (in-flight updates, as PipelineRL's and AReaL's) the
pause is vLLM's ``"keep"`` mode instead: requests in flight are frozen where they are, and resume
*on the new weights*, so a sample may span versions; vLLM labels each token with the version that
sampled it (``Sample.token_versions``) and the sample is tagged with its oldest. The KV cache of
the frozen requests is dropped (``clear_cache``: vLLM preempts them) and recomputed by the new
weights when they resume, as NeMo-RL's ``recompute_kv_cache_after_weight_updates`` does, not kept
as PipelineRL keeps it: so each token's behaviour log-probability is that of one policy, the
version its label names, given the whole prefix, which is what the learner's per-token
importance ratio assumes (docs/architecture.md section 3). A reload then waits for no request. An engine
that serves LoRA adapters (``rollout_server.adapters``) swaps the adapter in
the same pause instead, and holds back requests that arrive meanwhile until
the new one is in place. A reload
runs to its end even when its caller is cancelled (an actor whose run ended):
stopped between pause and resume, it would leave vLLM's scheduler paused.

**In vLLM's workers** (``worker_ext``, which vLLM imports there by its dotted path): a file
version is reloaded layer by layer with vLLM's in-place ``reload_weights``, a broadcast one is
received over the weight group and its digest checked before anything loads; both then repack a
language-model head tied to the embeddings, which the CPU backend would otherwise keep computing
with the old weights. The label registered in step 3 is what tags every token sampled afterwards
(``engine`` module docstring: version tags).

**Bounds** (the run config's ``[watchdog]``; ``engine`` module docstring): ``prepare`` past
``reload_s`` refuses the version; a drain past ``generate_s`` or an in-place load past ``reload_s``
fails the engine (the server exits for a restart).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

from rollout_server.adapters import AdapterTransport
from rollout_server.errors import EngineDead
from rollout_server.transports import (
    PREPARE_THREAD,
    BroadcastTransport,
    FilesystemTransport,
    Prepared,
    WeightLoadError,
    WeightTransport,
)
from services import watchdog
from services.weightstore import checkpoint_signature, reload_volume
from services.wire import LoadWeights, WeightsStatus

InFlight = Literal["wait", "keep"]
"""What a reload does with the requests in the engine (``publish.reload``)."""

log = logging.getLogger("tandem.rollout")


class WeightReloads:
    """The reload half of ``engine.RolloutEngine``: the version it serves and how a new one gets in.

    Uses the engine's ``llm``, ``model_dir``, ``metrics``, ``limits``, ``incidents``, ``source``,
    ``alive``, ``dead_reason``, ``_broken``, ``_stalled`` and ``_fail`` (``engine``); ``start`` sets
    ``workers``, and ``adapters`` on an engine that serves LoRA adapters."""

    def __init__(self, model_dir: Path, *, version: int, uri: str | None, volume: str | None,
                 broadcast_key: bytes) -> None:
        self.volume = volume  # a Modal Volume to reload before reading a version (TANDEM_RUN_DIR_VOLUME)
        self.version = version
        self.uri = uri or str(model_dir)
        self.reload_s: float | None = None
        reference = checkpoint_signature(model_dir)
        self.broadcast_key = broadcast_key
        """Admits this server to the learner's weight groups (``services.weightgroup.broadcast_key``)."""
        self.transports: list[WeightTransport] = [FilesystemTransport(reference),
                                                  BroadcastTransport(reference, broadcast_key)]
        self.workers = 1
        """vLLM workers this engine runs (its tensor-parallel size): the ranks it takes in a weight group;
        0 under vLLM data parallelism, whose replicas' workers one ``collective_rpc`` does not reach (it joins none)."""
        self.adapters: AdapterTransport | None = None
        """Set when vLLM serves LoRA adapters (``rollout_server.adapters``): versions are adapters on the base."""
        self._reload_lock = asyncio.Lock()
        self._swapped = asyncio.Event()  # cleared while a reload has vLLM paused: no request picks an adapter
        self._swapped.set()

    def status(self) -> WeightsStatus:
        return WeightsStatus(version=self.version, uri=self.uri, reload_s=self.reload_s)

    def _transport(self, uri: str) -> WeightTransport:
        for t in self.transports:
            if t.accepts(uri):
                return t
        raise WeightLoadError(422, f"no weight transport for {uri!r}")

    async def load_weights(self, request: LoadWeights, *, record: Callable[[], Awaitable[None]] | None = None,
                           in_flight: InFlight = "wait") -> WeightsStatus:
        """Load ``request.version`` in place; a no-op when it is not newer than the loaded one.

        Raises :class:`WeightLoadError` (engine untouched, old weights serving)
        for a missing or corrupt version. A caller cancelled half way does not
        stop the reload (:func:`_to_the_end`).

        ``record`` (the caller's ledger entry for the version: the actor's ``loaded`` or ``received``) is
        awaited right after the swap, only when this call swapped the version in, in the same task and under
        the same reload lock: a cancellation cannot leave the engine serving a version that its record says
        it never got (the last version of a run used to, its actor cancelled between the two).

        ``in_flight``: what becomes of the requests in the engine (the run's ``publish.reload``; module
        docstring): ``"wait"`` finishes them on the old weights first, ``"keep"`` goes on with them on the new.
        """
        if request.version <= self.version:
            return self.status()
        return await _to_the_end(self._load(request, record, in_flight), f"reload of version {request.version}")

    async def _load(self, request: LoadWeights, record: Callable[[], Awaitable[None]] | None = None,
                    in_flight: InFlight = "wait") -> WeightsStatus:
        async with self._reload_lock:
            if request.version <= self.version:  # another caller loaded it meanwhile
                return self.status()
            if not self.alive:
                raise EngineDead(self.dead_reason or "engine is down")
            t0 = time.monotonic()
            transport = self._transport(request.uri)
            try:
                if self.volume:
                    # a thread of its own: the default pool is shared with whatever else the process runs
                    await watchdog.in_thread(self._reload_volume, name=PREPARE_THREAD)
                prepared = await self._prepare(transport, request)
            except WeightLoadError:
                self.metrics.reloads.labels("refused").inc()
                raise
            await self._apply(transport, prepared, in_flight)
            self.reload_s = time.monotonic() - t0
            self.metrics.reload_s.observe(self.reload_s)
            self.metrics.reloads.labels("ok").inc()
            log.info(
                "loaded weight version %d from %s in %.3fs (%.1f MB)",
                request.version, request.uri, self.reload_s, prepared.bytes / 1e6,
            )
            if record is not None:
                await record()
            return self.status()

    def _reload_volume(self) -> None:
        try:
            reload_volume(self.volume)
        except Exception as e:  # Modal refuses while files are open, or cannot be reached
            raise WeightLoadError(503, f"cannot reload volume {self.volume!r}: {e}") from e

    async def reset_to_base(self) -> WeightsStatus:
        """Serve the model directory's own weights again, as version 0 (a new run starts from them).

        A no-op when nothing newer was loaded since start-up; like a reload, it
        runs to its end even if the caller is cancelled.
        """
        return await _to_the_end(self._reset_to_base(), "return to the base weights")

    async def _reset_to_base(self) -> WeightsStatus:
        base = LoadWeights(version=0, uri=str(self.model_dir))
        async with self._reload_lock:
            if self.version == 0 and self.uri == base.uri:
                return self.status()
            if not self.alive:
                raise EngineDead(self.dead_reason or "engine is down")
            transport = self._transport(base.uri)
            await self._apply(transport, await self._prepare(transport, base))
            log.info("back on the base weights of %s (version 0)", self.model_dir)
            return self.status()

    async def _prepare(self, transport: WeightTransport, request: LoadWeights) -> Prepared:
        """``transport.prepare`` within ``watchdog.reload_s``; past it the version is refused
        (503, engine untouched: the actor retries later) and the reading thread abandoned."""
        try:
            return await watchdog.bounded(
                transport.prepare(request), what=f"reload of version {request.version}",
                on=f"reading and verifying {request.uri}", limit_s=self.limits.reload_s, field="watchdog.reload_s",
                action=f"version refused, version {self.version} keeps serving; the actor retries later",
                sink=self.incidents, source=self.source, thread_prefix=PREPARE_THREAD,
            )
        except watchdog.Stalled as e:
            raise WeightLoadError(503, e.message) from e

    async def _within(self, aw: Coroutine[Any, Any, Any], *, what: str, on: str, drain: bool = False) -> Any:
        """Await one engine-side part of a reload within its bound (``generate_s`` for the ``drain`` of
        requests in flight, else ``reload_s``); past it the engine is stuck in an unknown state (paused,
        weights half-loaded): fail it (the server exits for a restart)."""
        field = "watchdog.generate_s" if drain else "watchdog.reload_s"
        limit = self.limits.generate_s if drain else self.limits.reload_s
        t0 = time.monotonic()
        task = asyncio.ensure_future(aw)
        try:
            async with asyncio.timeout(limit):
                return await asyncio.shield(task)
        except TimeoutError:
            stack = watchdog.task_stack(task)
            task.cancel()
            waited = time.monotonic() - t0
            await self._stalled(what, on, waited_s=waited, limit_s=limit, field=field, stack=stack,
                                action="engine failed: the server turns unhealthy and exits for a restart")
            reason = f"{what} has waited {waited:.1f} s on {on} (limit {limit:g} s, config {field}): the engine is stuck"
            self._fail(reason)
            raise EngineDead(reason) from None

    async def _apply(self, transport: WeightTransport, prepared: Prepared, in_flight: InFlight = "wait") -> None:
        request = prepared.request
        what = f"reload of version {request.version}"
        # "wait": in-flight requests finish on the old weights; new ones queue. "keep": they are frozen, their
        # KV cache is dropped and recomputed by the new weights when they resume (module docstring). An adapter
        # engine waits: a request is bound to the adapter it was sent with.
        keep = in_flight == "keep" and not isinstance(transport, AdapterTransport)
        self._swapped.clear()
        try:
            await self._within(pause(self.llm, "keep" if keep else "wait"), what=what,
                               on="vLLM to freeze the requests in flight (pause, keep mode)" if keep
                               else "requests in flight to finish (vLLM pause, wait mode)", drain=not keep)
        except BaseException:
            self._swapped.set()
            raise
        try:
            try:
                await self._within(transport.apply(self.llm, prepared), what=what,
                                   on="the in-place load in vLLM's workers")
            except (EngineDead, WeightLoadError):  # the latter: refused with the weights untouched
                raise
            except Exception as e:  # noqa: BLE001  the worker's error arrives as whatever it raised
                await self._restore(e, request)
                raise WeightLoadError(
                    422, f"version {request.version} failed to load ({e}); version {self.version} restored"
                ) from e
            await self._within(self.llm.update_weight_version(str(request.version)), what=what,
                               on="vLLM's weight-version label")
            self.version = request.version
            self.uri = request.uri
            self.metrics.version.set(request.version)
        finally:
            try:
                if self._broken is None:
                    await self._within(self.llm.resume_generation(), what=what, on="vLLM resuming generation")
            finally:
                self._swapped.set()

    async def _restore(self, error: Exception, request: LoadWeights) -> None:
        """A reload failed inside vLLM, possibly half way: put the previous version back."""
        self.metrics.reloads.labels("failed").inc()
        log.error("reload of version %d failed: %s; restoring version %d", request.version, error, self.version)
        try:
            previous = LoadWeights(version=self.version, uri=self.uri)
            t = self._transport(self.uri)
            await self._within(t.apply(self.llm, await self._prepare(t, previous)),
                               what=f"restore of version {self.version}", on="the in-place load in vLLM's workers")
        except EngineDead:
            raise
        except Exception as e2:  # noqa: BLE001  any failure here leaves the weights unknown
            self._broken = f"weights are inconsistent after a failed reload ({error}); restore failed: {e2}"
            self.metrics.engine_up.set(0)
            log.critical(self._broken)
            raise EngineDead(self._broken) from e2


async def pause(llm: Any, mode: Literal["keep", "wait"]) -> None:
    """vLLM's ``AsyncLLM.pause_generation(mode=mode, clear_cache=True)`` without the
    ``asyncio.sleep(0.02)`` it ends with, which its own comment calls "not required for correctness"
    (it lets the last outputs of a drain reach their streams before the caller goes on; a sample's
    tokens carry their versions whenever its output arrives). At one reload per learner step that was
    20 ms of a frozen engine per step (docs/performance.md, "2026-12-07: the rollout server's own CPU")."""
    await llm.renderer.clear_mm_cache_async()
    await llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=True)


async def _to_the_end(work: Coroutine[Any, Any, WeightsStatus], what: str) -> WeightsStatus:
    """Await ``work`` in a task that cancelling the caller does not interrupt.

    A reload pauses vLLM's scheduler and resumes it at the end; cancelled in
    between (an actor stopping because its run ended), it would leave new
    requests queued until some later reload resumed generation, or the
    weights half-loaded. So the reload finishes; the cancelled caller only
    stops waiting, and a failure nobody waits for any more is logged.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(functools.partial(_log_unawaited_failure, what))
        raise


def _log_unawaited_failure(what: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s (its caller had gone) failed: %s", what, task.exception())
