"""``tandem serve learner``: the training loop behind a small HTTP surface.

Rank 0 serves ``/healthz`` (503 once training failed), ``/metrics`` and
``GET /v1/status`` while the training loop runs in a background thread
(DeepSpeed steps block; the HTTP event loop must not). Other ranks of a
multi-rank job (``torchrun --nproc_per_node N -m deploy.cli serve learner``,
``tandem up`` with ``TANDEM_STACK_LEARNER_RANKS=N``) run the loop in their
main thread and serve nothing.

Two modes:

- ``TANDEM_RUN_ID`` set: train that run with ``--config`` (standalone).
- unset (the local stack, docker-compose): follow the control plane. Import
  what the engine needs (``learner.distributed.preload``), then wait
  for the active run in the run registry (``services.runs.RunStore``), mark
  it ``running``, train it with the config it was submitted with, mark it
  ``finished`` or ``failed``; stop early when it is stopped; end the run's
  leftover groups in its ledger (``learner.trainer.close_run``); then wait
  for the next run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from learner.distributed import preload
from learner.metrics import LearnerMetrics
from learner.settings import LearnerSettings
from learner.status import Status
from learner.trainer import Trainer, close_run
from services.app import create_app
from services.config import RunConfig
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

    @app.get("/v1/status", response_model=Status)
    async def status() -> Status:
        return trainer.status

    return app


class RunFollower:
    """Stack mode: train each run the control plane activates, one after the other."""

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
        from broker import Keys, connect
        from services.runs import RunStore, RunWatcher

        if not self.settings.redis_url:
            raise RuntimeError("the learner needs a Redis URL (REDIS_URL)")
        t0 = time.monotonic()
        preload()  # while no run is there: off the path from a run's start to its first step
        log.info("engine modules imported in %.1f s", time.monotonic() - t0)
        redis = connect(self.settings.redis_url)
        store = RunStore(redis)
        runs = RunWatcher(store, poll_s=self.settings.poll_s, stop=self.stop_event)
        lead = int(os.environ.get("RANK", "0")) == 0
        try:
            async for run in runs:
                trainer = Trainer(self.settings.model_copy(update={"run_id": run.run_id}), run.config, metrics=self.metrics)
                self.current = trainer
                if not lead:  # another rank of a multi-rank learner: rank 0 runs the run and says when it ends
                    await asyncio.to_thread(trainer.run_blocking, reraise=False)
                    continue
                await store.set_state(run.run_id, "running")
                watch = asyncio.create_task(self._stop_when_not_live(runs, run.run_id, trainer))
                try:
                    await asyncio.to_thread(trainer.run_blocking, reraise=False)
                finally:
                    watch.cancel()
                if trainer.status.state == "done":  # the trainer closed the run's ledger
                    await store.set_state(run.run_id, "finished")
                elif trainer.status.state == "failed":
                    await store.set_state(run.run_id, "failed", error=trainer.status.error or "learner failed")
                    await _close(redis, Keys(run.run_id), "run_failed", trainer)
                elif await store.is_live(run.run_id):  # stopped by SIGTERM, not by the user: leave it running
                    return
                else:  # stopped from the control plane
                    await _close(redis, Keys(run.run_id), "run_stopped", trainer)
        finally:
            await redis.aclose()

    @staticmethod
    async def _stop_when_not_live(runs, run_id: str, trainer: Trainer) -> None:
        """Stop the trainer once the run is stopped from the control plane (or the service stops)."""
        async for _ in runs.while_live(run_id):
            pass
        trainer.stop_event.set()


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
    serve_app(build_app(settings, config), settings)
