"""Stack mode: run the actor loop for whichever run the control plane activates.

A rollout server started without ``TANDEM_RUN_ID`` (``tandem up``,
docker-compose) follows the run registry with a
:class:`~services.runs.RunWatcher` (which validates each run's config and
fails a run whose config is invalid). When a run becomes active it starts an
:class:`~rollout_server.actor.Actor` with the run's config, reports its
throughput and idle fraction to the run's metrics log every few seconds,
and stops the actor once the run is no longer live (finished, stopped,
failed). Each run starts from the model directory's own weights (version
0), whatever the previous run left loaded. A run whose model is not the one
this server serves is not served (the learner and the control plane report
the run's state; this server logs why), nor one whose sampling its log-probs
do not describe (``raw_logprobs`` at a temperature other than 1:
``SamplingConfig.logprobs_refusal``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from broker import Keys, connect
from rollout_server.actor import Actor, cancel_and_wait, reward_client
from rollout_server.adapters import misfit
from rollout_server.engine import RolloutEngine
from rollout_server.metrics import RolloutMetrics
from rollout_server.settings import RolloutSettings
from rollout_server.tools import ToolBox
from services.config import serves_model
from services.runs import ActiveRun, MetricsLog, RunStore, RunWatcher
from services.timeline import Timeline

log = logging.getLogger("tandem.rollout")


async def follow_runs(
    engine: RolloutEngine, rs: RolloutSettings, metrics: RolloutMetrics, tools: ToolBox, *, poll_s: float = 0.5,
    report_s: float = 5.0
) -> None:
    """Serve active runs one after the other, until cancelled, with the server's ``tools``."""
    redis = connect(rs.redis_url)
    runs = RunWatcher(RunStore(redis), poll_s=poll_s)
    try:
        async for run in runs:
            if not serves_model(run.config, engine.model_dir):
                log.error("not serving run %s: it trains %s, this server serves %s",
                          run.run_id, run.config.model.path, engine.model_dir)
                continue  # the watcher does not offer it again
            if (why := misfit(run.config, engine.adapters) or
                    run.config.sampling.logprobs_refusal(engine.logprobs_mode)) is not None:
                log.error("not serving run %s: %s", run.run_id, why)
                continue
            await engine.reset_to_base()  # a previous run left its last version loaded
            keys = Keys(run.run_id)
            reward = reward_client(rs, redis, keys, run.config)
            timeline = Timeline(rs.redis_url, keys, f"rollout:{rs.name}").start()
            actor = Actor(engine, redis=redis, keys=keys, config=run.config, reward=reward,
                          server_id=rs.name, metrics=metrics, concurrency=rs.actor_concurrency, timeline=timeline,
                          tools=tools)
            task = asyncio.create_task(actor.run(), name=f"actor-{run.run_id}")
            log.info("serving run %s", run.run_id)
            try:
                await _serve(runs, run, task, MetricsLog(redis, keys), engine, metrics, rs.name, report_s)
            finally:
                await cancel_and_wait(task)  # a failure of the actor was raised by _serve
                await reward.aclose()
                await timeline.stop_async()
            log.info("run %s is over", run.run_id)
    finally:
        await redis.aclose()


async def _serve(
    runs: RunWatcher, run: ActiveRun, task: asyncio.Task, metrics_log: MetricsLog, engine: RolloutEngine,
    metrics: RolloutMetrics, name: str, report_s: float,
) -> None:
    """Wait while the run is live; every ``report_s`` append rollout tokens/s and idle fraction."""
    generated = metrics.registry.get_sample_value
    last_t, last_tokens = time.monotonic(), generated("tandem_rollout_generated_tokens_total") or 0.0
    busy = samples = 0
    async for _ in runs.while_live(run.run_id):
        if task.done():
            break
        samples += 1
        busy += (generated("tandem_rollout_groups_in_flight") or 0) > 0
        if time.monotonic() - last_t >= report_s:
            now, tokens = time.monotonic(), generated("tandem_rollout_generated_tokens_total") or 0.0
            await metrics_log.append(
                f"rollout:{name}", engine.version,
                rollout_tokens_per_s=(tokens - last_tokens) / (now - last_t),
                rollout_idle_frac=1.0 - busy / max(samples, 1),
            )
            last_t, last_tokens, busy, samples = now, tokens, 0, 0
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # the engine died: the server's watchdog exits non-zero
