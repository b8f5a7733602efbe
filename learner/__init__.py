"""The learner: DeepSpeed ZeRO GRPO training from the trajectories stream.

Who talks to whom: rank 0 reads trajectory groups from Redis
(``learner.feeder``), every rank trains on its share (``learner.engine``,
objective in ``learner.loss``; process group and named collectives in
``learner.distributed``, RNG state in ``learner.rng``), rank 0 publishes weight versions:
streams them to the rollout servers, writes them to the weight store and
registers them with the broker, old ones pruned (``learner.publisher``,
retention in ``learner.retention``); every rank saves checkpoints, and rank 0
acknowledges the groups a durable one holds (``learner.checkpoints``); rank 0
serves ``/healthz``, ``/metrics``, ``/v1/status`` (``learner.service``).
The loop, its order of operations and the resume design are in
``learner.trainer``.

This package import stays light (no torch): ``tandem serve learner`` imports
it and calls :func:`serve`.
"""

from __future__ import annotations


def build_app(settings, config):
    """The learner's FastAPI app (see ``learner.service.build_app``)."""
    from learner.service import build_app as _build

    return _build(settings, config)


def serve(settings, config) -> None:
    """Run the learner service (see ``learner.service.serve``)."""
    from learner.service import serve as _serve

    _serve(settings, config)
