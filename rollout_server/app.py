"""The rollout server process: app factory, lifespan, watchdog, entry point.

``build_app`` wires the engine (started in the lifespan, one per process and
owned by it), the HTTP routes, and, when the process serves a run (a run
config and ``TANDEM_RUN_ID``), the actor loop; with Redis but no run id it
follows the control plane's active run (``follower``). A watchdog turns a dead
engine (or an actor loop that stopped) into a failing ``/healthz`` and,
after ``fatal_grace_s``, a non-zero exit of :func:`serve`, so a supervisor
restarts the process.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from rollout_server.actor import Actor, cancel_and_wait
from rollout_server.adapters import lora_rank, lora_targets
from rollout_server.api import Pending, router
from rollout_server.engine import RolloutEngine
from rollout_server.metrics import RolloutMetrics
from rollout_server.openai_api import router as openai_router
from rollout_server.settings import RolloutSettings
from rollout_server.tools import ToolBox
from services.app import create_app
from services.config import RunConfig
from services.serving import EXIT_STARTUP_FAILED, log_to_stderr, run_server

log = logging.getLogger("tandem.rollout")

EXIT_ENGINE_DEAD = 1


def model_dir(settings: RolloutSettings, config: RunConfig | None) -> Path:
    if settings.model is not None:
        return settings.model
    if config is not None:
        return config.model.path
    raise ValueError("no model: pass --model DIR or a run config (--config RUN.toml)")


def build_app(rs: RolloutSettings, config: RunConfig | None = None, *, engine: RolloutEngine | None = None) -> FastAPI:
    """The rollout server app.

    ``engine``: serve an engine started elsewhere (tests share one per session);
    the app then neither starts nor shuts it down. Otherwise the lifespan starts
    one on ``--model`` or the run config's model and owns it.
    """
    if engine is None:
        path = model_dir(rs, config)
        metrics = RolloutMetrics(CollectorRegistry())
    else:
        path = engine.model_dir
        metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = engine is None
        eng = engine
        if eng is None:
            eng = await RolloutEngine.start(
                path,
                rs,
                metrics=metrics,
                max_model_len=rs.max_model_len or (config.model.max_model_len if config else None),
                dtype=rs.dtype or (config.model.dtype if config else None),
                lora_rank=rs.lora_rank or lora_rank(config),
                lora_targets=lora_targets(config),
            )
        app.state.engine = eng
        actor_task = None
        closers = []
        try:
            tools, closers = await _tools(eng, rs, metrics)
            app.state.tools = tools
            if config is not None and rs.run_id:
                actor_task, more = await _start_actor(eng, rs, config, metrics, tools)
                closers += more
            elif rs.redis_url:
                # stack mode (tandem up, docker-compose): serve whichever run the control plane activates
                from rollout_server.follower import follow_runs

                actor_task = asyncio.create_task(follow_runs(eng, rs, metrics, tools), name="follower")
            watchdog = asyncio.create_task(_watchdog(app, eng, actor_task, rs.fatal_grace_s), name="watchdog")
            try:
                yield
            finally:
                for t in (actor_task, watchdog):
                    if t is not None and (error := await cancel_and_wait(t)) is not None:
                        # already reported by the watchdog; not re-raised during shutdown
                        log.error("%s ended with %r", t.get_name(), error)
        finally:
            for close in closers:
                await close()
            if owned:
                eng.shutdown()

    async def health() -> bool:
        eng = getattr(app.state, "engine", None)
        return app.state.fatal is None and eng is not None and await eng.check_health()

    app = create_app("rollout", rs, lifespan=lifespan, health=health, registry=metrics.registry)
    app.state.settings = rs
    app.state.config = config
    app.state.fatal = None
    app.state.pending = Pending(rs.max_pending_seqs)
    app.state.request_exit = None
    app.include_router(router)
    app.include_router(openai_router)  # OpenAI-compatible routes and vLLM's token-in route
    return app


async def _tools(eng: RolloutEngine, rs: RolloutSettings, metrics: RolloutMetrics):
    """The server's tools: the calculator, the user tools (one pool of worker processes for the whole
    server, ``rs.tool_workers``), python in the reward server's sandboxes, within ``rs``'s limits; and
    their closers. Episodes asked for over ``/v1/generate`` (held-out evaluation of episode lines) use
    them as they are; an actor gives them its run's reward client and incident log."""
    from rollout_server.tools import ToolLimits, user_tools
    from services.clients import RewardClient

    pool = await user_tools(rs.tools, rs.tool_workers)  # a tool that cannot be imported stops the server
    reward = RewardClient(rs.reward_url, rs.reward_bearer, timeout_s=rs.score_timeout_s)
    tools = ToolBox(reward=reward, user=pool, limits=ToolLimits(rs.tool_timeout_s, rs.tool_episode_s),
                    source=eng.source, metrics=metrics)
    return tools, [pool.close, reward.aclose]


async def _start_actor(eng: RolloutEngine, rs: RolloutSettings, config: RunConfig, metrics: RolloutMetrics,
                       tools: ToolBox):
    from broker import Keys, connect
    from rollout_server.actor import reward_client
    from services.timeline import Timeline

    if not rs.redis_url:
        raise ValueError("the actor loop needs Redis: set REDIS_URL")
    if (why := config.sampling.logprobs_refusal(eng.logprobs_mode)) is not None:
        raise ValueError(why)
    redis = connect(rs.redis_url)
    reward = reward_client(rs, redis, Keys(rs.run_id), config)
    timeline = Timeline(rs.redis_url, Keys(rs.run_id), f"rollout:{rs.name}").start()
    actor = Actor(
        eng,
        timeline=timeline,
        redis=redis,
        keys=Keys(rs.run_id),
        config=config,
        reward=reward,
        server_id=rs.name,
        metrics=metrics,
        concurrency=rs.actor_concurrency,
        tools=tools,
    )
    return asyncio.create_task(actor.run(), name="actor"), [reward.aclose, redis.aclose, timeline.stop_async]


async def _watchdog(app: FastAPI, eng: RolloutEngine, actor_task: asyncio.Task | None, grace_s: float) -> None:
    while True:
        await asyncio.sleep(0.5)
        reason = None
        if not eng.alive:
            reason = eng.dead_reason
        elif actor_task is not None and actor_task.done():
            exc = None if actor_task.cancelled() else actor_task.exception()
            reason = f"actor loop stopped: {exc!r}"
        if reason is None:
            continue
        app.state.fatal = reason
        log.critical("rollout server is failing: %s; exiting in %.1fs", reason, grace_s)
        await asyncio.sleep(grace_s)  # let /healthz report it first
        if app.state.request_exit is not None:
            app.state.request_exit()
        return


def serve(settings: RolloutSettings, config: RunConfig | None = None) -> None:
    """``tandem serve rollout``: run the server until SIGINT/SIGTERM or engine death.

    Exits 1 when the engine (or the actor loop) died, 3 when startup failed.
    A port that is taken is found before the engine starts; one taken while
    it starts ends the engine again (uvicorn runs the lifespan's shutdown),
    and the last line names the port (``services.serving.run_server``).
    """
    import uvicorn

    log_to_stderr(settings.log_level)
    app = build_app(settings, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)
    )

    def request_exit() -> None:
        server.should_exit = True

    app.state.request_exit = request_exit
    run_server(server, "rollout")
    if not server.started:
        sys.exit(EXIT_STARTUP_FAILED)
    if app.state.fatal is not None:
        log.critical("exiting: %s", app.state.fatal)
        sys.exit(EXIT_ENGINE_DEAD)
