"""``tandem serve learner``: the training loop behind a small HTTP surface.

Rank 0 serves ``/healthz`` (503 once training failed), ``/metrics`` and
``GET /v1/status`` while the training loop runs in a background thread
(DeepSpeed steps block; the HTTP event loop must not). Other ranks of a
multi-rank job (``torchrun --nproc_per_node N -m deploy.cli serve learner``,
``tandem up`` with ``TANDEM_STACK_LEARNER_RANKS=N``) run the loop in their
main thread and serve nothing.

Three modes:

- ``TANDEM_RUN_ID`` set: train that run with ``--config`` (standalone; no
  run registry, no lease).
- unset (the local stack, docker-compose): follow the control plane. Import
  what the engine needs (``learner.distributed.preload``), then wait
  for the active run in the run registry (``services.runs.RunStore``), take
  its lease, mark it ``running``, train it with the config it was submitted
  with, mark it ``finished`` (with ``eval.after``, once the final version's
  held-out evaluation is recorded: :func:`evaluate_final`) or ``failed``; stop
  early when it is stopped;
  end the run's leftover groups in its ledger (``learner.trainer.close_run``);
  then wait for the next run.
- ``TANDEM_LEARNER_ONE_RUN`` set (Modal: the control plane spawns a learner
  per run): the same for that one run, then the process exits (rank 0 stops
  its HTTP server). A run that is no longer live is not trained.

One learner per run: rank 0 holds the run's lease (``broker.lease``,
``Keys.learner_lease``) while it trains it and renews it every third of
``TANDEM_LEARNER_LEASE_S``. A learner that finds another holder waits 1.5
leases for it (a holder that died stops renewing) and otherwise leaves the
run alone, naming the holder in its log; in one-run mode it then exits with
status 0, so Modal does not retry it. The other ranks of a job train only
once they see their job's id (``TANDEM_LEARNER_HOLDER``) in the lease. A
learner that loses its lease (no renewal for a whole lease) ends its process
at once, without a checkpoint: resuming from the last one is always sound
(``learner.trainer``), two learners writing one run's checkpoints is not.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from learner.distributed import preload
from learner.metrics import LearnerMetrics
from learner.settings import LearnerSettings
from learner.status import Status
from learner.trainer import Trainer, close_run
from services.app import create_app
from services.config import RunConfig
from services.serving import run_server
from services.serving import serve as serve_app

log = logging.getLogger("tandem.learner")


def build_app(settings: LearnerSettings, config: RunConfig | None) -> FastAPI:
    """The learner's app; its lifespan starts the training thread and stops it at shutdown."""
    metrics = LearnerMetrics()
    if settings.run_id:
        if config is None:
            raise ValueError("TANDEM_RUN_ID is set: the learner needs --config RUN.toml for it")
        trainer = Trainer(settings, config, metrics=metrics)
    else:
        trainer = RunFollower(settings, metrics)

    def _train() -> None:
        trainer.run_blocking(reraise=False)  # a failure stays visible in /v1/status and /healthz
        if settings.one_run and not trainer.stop_event.is_set() and app.state.run_over is not None:
            app.state.run_over()  # the run is over: stop serving, so the process (and the Modal call) ends

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        thread = threading.Thread(target=_train, name="learner-train", daemon=True)
        thread.start()
        app.state.train_thread = thread
        yield
        trainer.stop_event.set()
        thread.join(timeout=30)

    async def health() -> bool:
        return trainer.status.state != "failed"

    app = create_app("learner", settings, lifespan=lifespan, health=health, registry=metrics.registry)
    app.state.trainer = trainer
    app.state.run_over = None
    """Called (from the training thread) when a one-run learner's run is over; :func:`serve` sets it."""

    @app.get("/v1/status", response_model=Status)
    async def status() -> Status:
        return trainer.status

    return app


LEASE_LOST_EXIT = 75
"""Exit status of a learner that lost its run's lease (EX_TEMPFAIL: Modal retries the call)."""


class RunFollower:
    """Stack mode: train each run the control plane activates, one after the other (one-run mode:
    ``settings.one_run`` only)."""

    def __init__(self, settings: LearnerSettings, metrics: LearnerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.stop_event = threading.Event()
        self.current: Trainer | None = None
        self.idle = Status(state="idle")

    @property
    def run_id(self) -> str | None:
        return self.current.run_id if self.current else None

    @property
    def status(self) -> Status:
        return self.current.status if self.current else self.idle

    def run_blocking(self, *, reraise: bool = True) -> None:
        try:
            asyncio.run(self._follow())
        except Exception as e:
            self.idle.state, self.idle.error = "failed", f"{type(e).__name__}: {e}"
            log.exception("learner run follower failed")
            if reraise:
                raise

    async def _follow(self) -> None:
        from broker import connect
        from services.runs import RunStore, RunWatcher

        if not self.settings.redis_url:
            raise RuntimeError("the learner needs a Redis URL (REDIS_URL)")
        t0 = time.monotonic()
        preload()  # while no run is there: off the path from a run's start to its first step
        log.info("engine modules imported in %.1f s", time.monotonic() - t0)
        redis = connect(self.settings.redis_url)
        store = RunStore(redis)
        runs = RunWatcher(store, poll_s=self.settings.poll_s, stop=self.stop_event)
        try:
            source = self._one_run(store) if self.settings.one_run else runs
            async for run in source:
                lease = await self._take_lease(redis, run.run_id)
                if lease is None:
                    continue
                try:
                    if await self._train(redis, store, runs, run) == "interrupted":
                        return
                finally:
                    await lease.stop()
        finally:
            await redis.aclose()

    async def _train(self, redis, store, runs, run) -> str:
        """Train ``run`` to its end; "interrupted" when SIGTERM stopped it while it is still live."""
        from broker import Keys

        trainer = Trainer(self.settings.model_copy(update={"run_id": run.run_id}), run.config, metrics=self.metrics)
        self.current = trainer
        if not self._lead:  # another rank of a multi-rank learner: rank 0 runs the run and says when it ends
            await asyncio.to_thread(trainer.run_blocking, reraise=False)
            return trainer.status.state
        await store.set_state(run.run_id, "running")
        watch = asyncio.create_task(self._stop_when_not_live(runs, run.run_id, trainer))
        try:
            await asyncio.to_thread(trainer.run_blocking, reraise=False)
        finally:
            watch.cancel()
        if trainer.status.state == "done":  # the trainer closed the run's ledger
            if run.config.eval.after:
                await evaluate_final(redis, Keys(run.run_id), self.stop_event)
            await store.set_state(run.run_id, "finished")
        elif trainer.status.state == "failed":
            await store.set_state(run.run_id, "failed", error=trainer.status.error or "learner failed")
            await _close(redis, Keys(run.run_id), "run_failed", trainer)
        elif await store.is_live(run.run_id):  # stopped by SIGTERM, not by the user: leave it running
            return "interrupted"
        else:  # stopped from the control plane, or failed by a rollout server (reward.fail_after)
            failed = (await store.get(run.run_id)).state == "failed"
            await _close(redis, Keys(run.run_id), "run_failed" if failed else "run_stopped", trainer)
        return trainer.status.state

    @property
    def _lead(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    async def _one_run(self, store) -> AsyncIterator:
        """One-run mode's source of runs: ``settings.one_run`` if it is live, with its config."""
        from services.config import parse_run_config
        from services.runs import ActiveRun

        run_id = self.settings.one_run
        record = await store.get(run_id)
        if not await store.is_live(run_id):
            log.info("run %s is %s: nothing to train", run_id, record.state)
            return
        yield ActiveRun(record, parse_run_config(record.config, f"run {run_id}"))

    async def _take_lease(self, redis, run_id: str) -> _HeldLease | None:
        """This job's hold on ``run_id``'s lease, or None (logged, naming the holder) when another
        learner keeps it. Rank 0 takes it; the other ranks wait to see their job's id in it."""
        from broker import Keys, Lease

        s = self.settings
        lease = Lease(redis, Keys(run_id).learner_lease, s.holder_id, s.lease_s)
        if self._lead:
            other = await lease.acquire(wait_s=1.5 * s.lease_s, poll_s=min(1.0, s.lease_s / 10))
            if other is None:
                log.info("run %s: learner %s holds its lease", run_id, s.holder_id)
                return _HeldLease(lease, renew=True)
        else:
            deadline = time.monotonic() + 3 * s.lease_s  # longer than rank 0 waits: its decision shows first
            while (other := await lease.current()) != s.holder_id and time.monotonic() < deadline:
                await asyncio.sleep(min(0.5, s.lease_s / 10))
            if other == s.holder_id:
                return _HeldLease(lease, renew=False)
        log.warning("not training run %s: learner %s holds its lease (this learner is %s)",
                    run_id, other, s.holder_id)
        return None

    @staticmethod
    async def _stop_when_not_live(runs, run_id: str, trainer: Trainer) -> None:
        """Stop the trainer once the run is stopped from the control plane (or the service stops)."""
        async for _ in runs.while_live(run_id):
            pass
        trainer.stop_event.set()


class _HeldLease:
    """A run's lease while this job trains it: rank 0 renews it every third of its length and, should a
    renewal fail for a whole lease, ends the process (module docstring); released at the end."""

    def __init__(self, lease, *, renew: bool) -> None:
        self.lease = lease
        self.task = asyncio.create_task(self._renew(), name="learner-lease") if renew else None

    async def _renew(self) -> None:
        from redis.exceptions import RedisError

        lease, renewed = self.lease, time.monotonic()
        while True:
            await asyncio.sleep(lease.ttl_s / 3)
            try:
                if await lease.renew():
                    renewed = time.monotonic()
                    continue
                why = f"it is now held by {await lease.current()}"
            except RedisError as e:
                if time.monotonic() - renewed < lease.ttl_s:
                    continue  # a Redis hiccup: the lease still runs
                why = f"it could not be renewed for {lease.ttl_s:g} s: {e!r}"
            log.critical("learner %s lost the lease %s (%s): exiting without a checkpoint",
                         lease.holder, lease.key, why)
            os._exit(LEASE_LOST_EXIT)

    async def stop(self) -> None:
        """Stop renewing; rank 0 releases the lease (the next learner of the run need not wait)."""
        if self.task is None:
            return
        from redis.exceptions import RedisError

        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        try:
            await self.lease.release()
        except RedisError as e:  # the lease then expires by itself within its length
            log.warning("could not release the lease %s: %r", self.lease.key, e)


async def _close(redis, keys, reason: str, trainer: Trainer) -> None:
    """End a failed or stopped run's ledger (``close_run``); its own failure (the full disk that failed
    the run, say) is logged, not raised: the run's state is set already."""
    try:
        await close_run(redis, keys, reason, trainer.paths.ledger)
    except Exception:
        log.exception("could not close the ledger of run %s (%s)", keys.run_id, reason)


def serve(settings: LearnerSettings, config: RunConfig | None) -> None:
    """Entry point of ``tandem serve learner`` (and of every rank under torchrun).

    Ranks > 0 serve nothing: with ``TANDEM_RUN_ID`` they train that run with ``--config``; in stack
    mode they follow the same runs as rank 0 (each rank watches the run registry; rank 0 alone
    changes a run's state and tells the others, step by step, what to do)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0 and settings.run_id and config is None:
        raise SystemExit("TANDEM_RUN_ID is set: ranks > 0 need --config RUN.toml")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if rank > 0:
        if settings.run_id:
            Trainer(settings, config).run_blocking()
        else:
            RunFollower(settings, LearnerMetrics()).run_blocking()
        return
    app = build_app(settings, config)
    if not settings.one_run:
        serve_app(app, settings)
        return
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                           access_log=False))
    app.state.run_over = lambda: setattr(server, "should_exit", True)  # exits 0: no signal to re-raise
    run_server(server, app.title)


FINAL_EVAL_WAIT_S = 600.0
"""The longest a finished run waits for its final version's held-out result (``eval.after``)."""


async def evaluate_final(redis, keys, stop: threading.Event, wait_s: float = FINAL_EVAL_WAIT_S) -> None:
    """``eval.after``: ask the rollout servers to evaluate the run's final version (``EvalLog.request``; they
    do it as for a version ``eval.every`` names) and wait until it is recorded, so that the run is marked
    finished with it, whoever started the run (``tandem run`` or ``tandem submit``). A run without held-out
    prompts has nothing to wait for; past ``wait_s`` (no rollout server left, an evaluation that failed) the
    run finishes without it, logged."""
    from broker import WeightRegistry
    from services.evaluate import EvalLog

    evals = EvalLog(redis, keys)
    latest = await WeightRegistry(redis, keys).latest()
    if latest is None or not await redis.llen(keys.eval_prompts):
        return
    await evals.request(latest.version)
    deadline = time.monotonic() + wait_s
    while latest.version not in await evals.points():
        if time.monotonic() > deadline or stop.is_set():
            log.warning("run %s: no held-out result of its final version %d after %.0f s; finishing without it",
                        keys.run_id, latest.version, wait_s)
            return
        await asyncio.sleep(0.5)
    log.info("run %s: final version %d evaluated", keys.run_id, latest.version)
