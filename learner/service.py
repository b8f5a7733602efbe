"""``tandem serve learner``: the training loop behind a small HTTP surface.

Rank 0 serves ``/healthz`` (503 once training failed), ``/metrics`` and
``GET /v1/status`` while the training loop runs in a background thread
(DeepSpeed steps block; the HTTP event loop must not). Other ranks of a
multi-rank job (``torchrun --nproc_per_node N -m learner --config RUN.toml``)
run the loop in their main thread and serve nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from learner.metrics import LearnerMetrics
from learner.trainer import Trainer
from services.app import create_app
from services.app import serve as serve_app
from services.config import RunConfig
from services.settings import ServiceSettings

log = logging.getLogger("tandem.learner")


def build_app(settings: ServiceSettings, config: RunConfig) -> FastAPI:
    """The learner's app; its lifespan starts the training thread and stops it at shutdown."""
    metrics = LearnerMetrics()
    trainer = Trainer(settings, config, metrics=metrics)

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

    @app.get("/v1/status")
    async def status() -> dict:
        return {"run_id": trainer.run_id} | trainer.status.as_dict()

    return app


def serve(settings: ServiceSettings, config: RunConfig | None) -> None:
    """Entry point of ``tandem serve learner`` (and of every rank under torchrun)."""
    if config is None:
        raise SystemExit("tandem serve learner needs --config RUN.toml")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if int(os.environ.get("RANK", "0")) > 0:
        Trainer(settings, config).run_blocking()
        return
    serve_app(build_app(settings, config), settings)
