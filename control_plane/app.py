"""The control plane's REST API (docs/architecture.md section 8).

Who talks to whom: users and ``tandem submit/status`` call these routes;
the control plane stores prompt sets and runs in Redis and enqueues prompt
groups on the run's ``prompts`` stream. It calls no other service but
one: when ``TANDEM_CONTROL_REWARD_URL`` is set it asks the reward server's
``POST /v1/check`` whether the python reward functions a prompt set or run
names may be called (``control_plane.reward_functions``). The learner and
rollout servers find the active run in the registry (``services.runs``) and
report progress and metrics there, which the status, metrics and dashboard
routes read back.

Who may do what: ``services.security``'s scopes (``read``, ``submit``, ``admin``); a prompt set
and a run are owned by the token that made them, and deleting or stopping another token's needs
``admin`` (403).

Errors map to statuses in one place (:func:`_errors`): unknown prompt set
(``prompt_set_id`` or ``eval_prompt_set_id``, named in the message) or run 404, a second active run or an impossible transition 409, bad input 422
(naming the line or field), uploads over ``max_prompt_set_bytes`` 413, and
past ``max_stored_prompt_set_bytes`` for all sets together 507 (``control_plane.prompt_sets``),
more than ``MAX_UPLOADS`` uploads at once 429 with ``Retry-After``.

Under load: the control plane holds at most :data:`REDIS_CONNECTIONS` Redis
connections (a request that finds them all busy waits up to
:data:`REDIS_WAIT_S` for one), so a burst of dashboard polls neither opens a
connection per request nor exhausts Redis's clients; a request Redis cannot
serve (no free connection in time, Redis down or refusing) is 503 with
``Retry-After``, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from broker import Admission, Keys, Stream, WeightRegistry, connect
from broker.embedded import EmbeddedRedis
from control_plane.dashboard import router as dashboard_router
from control_plane.groups import build_groups, enqueue
from control_plane.model_path import ModelNotVisible, deployed_model
from control_plane.prompt_sets import PromptSetStore
from control_plane.reward_functions import FunctionCheck, Named, spec_functions
from control_plane.settings import ControlSettings
from control_plane.stalls import StallMonitor
from control_plane.trackers import TrackerHub
from services.app import ServiceError, create_app
from services.config import ConfigError, RunConfig, parse_run_config, serves_model
from services.evaluate import EvalLog, eval_prompts
from services.prompt_forms import chat_template_in
from services.prompt_lines import LineError
from services.reward_specs import REWARD_TYPES, RewardSpec
from services.runs import (
    CompletionsLog,
    MetricsLog,
    RunConflict,
    RunStore,
    TransitionError,
    UnknownRun,
)
from services.security import principal_of
from services.watchdog import IncidentLog
from services.wire import (
    CompletionsPage,
    CpuAccount,
    CreateRun,
    EvalPrompt,
    MetricsPage,
    PromptSetInfo,
    RunCreated,
    RunRecord,
    RunStatus,
    Staleness,
    Throughput,
)

PROMPT_SETS_PATH = "/v1/prompt-sets"
log = logging.getLogger("tandem.control")
UPLOAD_TYPES = ("application/x-ndjson", "application/jsonl", "application/json", "text/plain", "application/octet-stream")

INCIDENTS_SHOWN = 20
"""Watchdog incidents ``GET /v1/runs/{id}`` returns (the newest)."""

REDIS_CONNECTIONS = 32
"""Redis connections the control plane holds at most (its requests share them)."""
REDIS_WAIT_S = 5.0
"""How long a request waits for a free Redis connection before it is answered 503."""
REDIS_RETRY_AFTER_S = 2
"""``Retry-After`` of a 503 for a request Redis could not serve."""

router = APIRouter(prefix="/v1")


def _state(request: Request):
    return request.app.state


def new_run_id(name: str) -> str:
    return f"{name[:40]}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


@router.post(
    "/prompt-sets",
    status_code=201,
    response_model=PromptSetInfo,
    summary="Upload a prompt set (JSON lines)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {t: {"schema": {"type": "string"}} for t in ("application/x-ndjson", "text/plain")},
            "description": 'One JSON object a line: {"prompt": str, "type": <reward type>, ...spec fields}.',
        }
    },
)
async def upload_prompt_set(
    request: Request,
    default_type: Annotated[str, Query(description="Reward type untyped lines are checked against.")] = "math",
) -> PromptSetInfo:
    """Validate line by line off the event loop (422 names each bad line and field), then store all lines or none."""
    if default_type not in REWARD_TYPES or default_type == "combined":
        raise ServiceError(422, f"default_type: unknown reward type {default_type!r}")
    content_type = request.headers.get("content-type", "application/x-ndjson").split(";")[0].strip().lower()
    if content_type not in UPLOAD_TYPES:
        raise ServiceError(415, f"send JSON lines as application/x-ndjson, not {content_type}")
    if request.headers.get("content-encoding", "identity").lower() != "identity":
        raise ServiceError(415, "send the prompt set uncompressed (no Content-Encoding)")
    return await _state(request).prompt_sets.upload(request.stream(), default_type, principal_of(request).owner)


@router.get("/prompt-sets", response_model=list[PromptSetInfo], summary="Stored prompt sets, newest first")
async def list_prompt_sets(request: Request,
                           limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[PromptSetInfo]:
    return await _state(request).prompt_sets.list(limit)


@router.get("/prompt-sets/{set_id}", response_model=PromptSetInfo, summary="A stored prompt set's meta")
async def get_prompt_set(set_id: str, request: Request) -> PromptSetInfo:
    info = await _state(request).prompt_sets.info(set_id)
    if info is None:
        raise ServiceError(404, f"no prompt set {set_id}")
    return info


@router.delete("/prompt-sets/{set_id}", response_model=PromptSetInfo, summary="Delete a stored prompt set")
async def delete_prompt_set(set_id: str, request: Request) -> PromptSetInfo:
    """Runs already created from the set keep their prompts (enqueued when they were created). Another
    token's set needs the ``admin`` scope (403)."""
    store = _state(request).prompt_sets
    if await store.info(set_id) is None:
        raise ServiceError(404, f"no prompt set {set_id}")
    _may_manage(request, f"prompt set {set_id}", await store.owner(set_id), "deleting")
    info = await store.delete(set_id)
    if info is None:
        raise ServiceError(404, f"no prompt set {set_id}")
    return info


def _may_manage(request: Request, what: str, owner: str | None, doing: str) -> None:
    """403 unless the request's token made ``what`` or holds the ``admin`` scope (``services.security``)."""
    if not principal_of(request).may_manage(owner):
        raise ServiceError(403, f"{what} was {'made by another token' if owner else 'made without a token'}: "
                                f"{doing} it needs the 'admin' scope")


@router.post("/runs", status_code=201, response_model=RunCreated, summary="Start a run")
async def create_run(body: CreateRun, request: Request) -> RunCreated:
    """Validate everything, then register the run (409 while another is active) and enqueue its groups."""
    state = _state(request)
    raw = body.config if body.config is not None else state.default_config
    if raw is None:
        raise ServiceError(422, "config: field required (this control plane has no default run config)")
    config = parse_run_config(raw, "config")
    try:  # the model as the rollout servers and the learner will read it (control_plane.model_path)
        config = await asyncio.to_thread(deployed_model, config, body.client_run_dir, state.settings.run_dir,
                                         state.settings.run_dir_volume, state.settings.model_dirs)
    except ModelNotVisible as e:
        raise ServiceError(422, str(e)) from None
    fleet = state.settings.fleet_model
    if fleet is not None and not serves_model(config, fleet):
        raise ServiceError(422, f"model.path: {config.model.path} is not the model this deployment's rollout servers "
                                f"serve, {fleet}; train that one, or deploy a fleet for this model")
    if await state.prompt_sets.info(body.prompt_set_id) is None:
        raise ServiceError(404, f"no prompt set {body.prompt_set_id}")
    chat = await asyncio.to_thread(chat_template_in, config.model.path)
    if chat is None:
        log.info("cannot tell whether %s has a chat template (no tokenizer or model files in it yet): "
                 "messages are accepted, and a rollout server refuses them if it has none", config.model.path)
    held_out = await _eval_prompts(state, body.eval_prompt_set_id, config, chat)
    lines = await state.prompt_sets.lines(body.prompt_set_id)
    run_id = new_run_id(config.name)
    try:
        groups = build_groups(run_id, lines, config, chat)
    except LineError as e:
        raise ServiceError(422, f"prompt set {body.prompt_set_id} under this config: {e}", errors=e.errors) from None
    await _check_functions(state, [(g.index + 1, g.spec) for g in groups if g.epoch == 0],
                           f"prompt set {body.prompt_set_id} under this config")
    await _check_functions(state, [(i, p.spec) for i, p in enumerate(held_out, start=1)],
                           f"eval_prompt_set_id: prompt set {body.eval_prompt_set_id} under this config")
    await state.trackers.open(run_id, config)  # 422 naming a tracker that cannot start (control_plane.trackers)
    # stored before the run is visible: a rollout server evaluates version 0 as soon as it sees the run
    await EvalLog(state.redis, Keys(run_id)).store_prompts(held_out)
    try:
        await state.runs.create(run_id, body.prompt_set_id, config.model_dump(mode="json"), principal_of(request).owner)
    except (RunConflict, ValueError):
        await state.redis.delete(Keys(run_id).eval_prompts)  # the run never existed
        await state.trackers.discard(run_id)
        raise
    try:
        count = await enqueue(state.redis, Keys(run_id), groups)
    except RedisError as e:
        await state.runs.set_state(run_id, "failed", error=f"enqueue failed: {e}")
        raise ServiceError(503, f"could not enqueue the run's prompt groups: {e}", retry_after=5) from None
    if state.start_learner is not None:  # Modal: a learner job per run (deploy.modal_app)
        try:
            await state.start_learner(run_id)
        except LearnerStartError as e:
            await state.runs.set_state(run_id, "failed", error=f"could not start its learner: {e}")
            raise ServiceError(503, f"could not start the run's learner: {e}", retry_after=30) from None
    return RunCreated(run_id=run_id, groups=count)


class LearnerStartError(RuntimeError):
    """``start_learner`` could not start the run's learner (the run is then failed, and the request 503)."""


async def _check_functions(state, specs: list[tuple[int, RewardSpec]], what: str) -> None:
    """422 naming the line and field of each python reward function the reward server refuses
    (``control_plane.reward_functions``); ``specs``: (1-based line, spec as the run completes it)."""
    named: Named = {}
    for line, spec in specs:
        for field, function, keywords in spec_functions(spec.model_dump(mode="json")):
            named.setdefault((function, keywords), (line, field))
    refused = await state.functions.refusals(named)
    if refused:
        raise ServiceError(422, f"{what}: {LineError(refused)}", errors=refused)


async def _eval_prompts(state, set_id: str | None, config: RunConfig, chat: bool | None) -> list[EvalPrompt]:
    """The run's held-out prompts (``services.evaluate``); 404/422 naming ``eval_prompt_set_id``."""
    if set_id is None:
        if config.eval.every > 0:
            raise ServiceError(422, f"eval_prompt_set_id: required: the config asks for an evaluation every "
                                    f"{config.eval.every} versions (eval.every); upload the held-out prompts first")
        return []
    if await state.prompt_sets.info(set_id) is None:
        raise ServiceError(404, f"eval_prompt_set_id: no prompt set {set_id}")
    try:
        return eval_prompts(await state.prompt_sets.lines(set_id), config, chat)
    except LineError as e:
        raise ServiceError(422, f"eval_prompt_set_id: prompt set {set_id} under this config: {e}",
                           errors=e.errors) from None


@router.get("/runs", response_model=list[RunRecord], summary="Runs, newest first")
async def list_runs(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[RunRecord]:
    return await _state(request).runs.list(limit)


async def _cpu(redis, keys: Keys, samples_trained: int) -> CpuAccount | None:
    """The run's CPU account as the stack that runs its services last wrote it (``deploy.cpu_account``),
    per trained sample; None without one, or if it cannot be read."""
    raw = await redis.get(keys.cpu)
    try:
        return CpuAccount.model_validate_json(raw).per_sample(samples_trained) if raw else None
    except ValueError:
        log.warning("run %s: unreadable CPU account ignored", keys.run_id)
        return None


@router.get("/runs/{run_id}", response_model=RunStatus, summary="A run's state, progress, staleness, throughput")
async def run_status(run_id: str, request: Request) -> RunStatus:
    state = _state(request)
    run = await state.runs.get(run_id)
    keys = Keys(run_id)
    config = RunConfig.model_validate(run.config)
    summary = await MetricsLog(state.redis, keys).summary()
    last, first, peak = summary["last"], summary["first"], summary["max"]
    counters = {k.decode(): int(v) for k, v in (await state.redis.hgetall(keys.counters)).items()}
    admission = Admission(
        state.redis, keys, max_staleness=config.staleness.max_staleness, groups_per_step=config.learner.groups_per_step
    )
    counts = await admission.counts()
    prompts = Stream.prompts(state.redis, keys)
    latest = await WeightRegistry(state.redis, keys).latest()
    evals = await EvalLog(state.redis, keys).points()
    return RunStatus(
        run=run,
        reward_mean=last.get("reward_mean"),
        accuracy=last.get("accuracy"),
        accuracy_first=first.get("accuracy"),
        eval=evals[max(evals)] if evals else None,
        weights_version=latest.version if latest else None,
        staleness=Staleness(
            max_staleness=config.staleness.max_staleness,
            max_observed_lag=peak.get("lag_max"),
            stale_dropped=counters.get("stale_dropped", 0),
            queued=counts["queued"],
            in_flight=counts["in_flight"],
            backlog=max(0, await prompts.backlog() - await prompts.pending()),
        ),
        throughput=Throughput(
            rollout_tokens_per_s=last.get("rollout_tokens_per_s"),
            learner_tokens_per_s=last.get("learner_tokens_per_s"),
            rollout_idle_frac=last.get("rollout_idle_frac"),
            learner_idle_frac=last.get("learner_idle_frac"),
        ),
        counters=counters,
        incidents=await IncidentLog(state.redis, keys).recent(INCIDENTS_SHOWN),
        cpu=await _cpu(state.redis, keys, counters.get("accepted", 0) * config.sampling.group_size),
    )


@router.get("/runs/{run_id}/metrics", response_model=MetricsPage, summary="A run's metrics time series")
async def run_metrics(
    run_id: str,
    request: Request,
    since: Annotated[str | None, Query(description="Only points after this id (a previous page's `next`).")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
) -> MetricsPage:
    state = _state(request)
    await state.runs.get(run_id)
    try:
        points = await MetricsLog(state.redis, Keys(run_id)).read(since, limit)
    except ValueError as e:
        raise ServiceError(422, f"since: {e}") from None
    return MetricsPage(run_id=run_id, points=points, next=points[-1].id if points else since)


@router.get("/runs/{run_id}/completions", response_model=CompletionsPage, summary="A run's completions table")
async def run_completions(
    run_id: str,
    request: Request,
    since: Annotated[str | None, Query(description="Only rows after this id (a previous page's `next`).")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
    newest: Annotated[bool, Query(description="The newest `limit` rows instead (`since` ignored).")] = False,
) -> CompletionsPage:
    """Trained samples, ``logging.completions`` per learner step, with what reward functions logged for them
    (``log_extra``), oldest first."""
    state = _state(request)
    await state.runs.get(run_id)
    log_ = CompletionsLog(state.redis, Keys(run_id))
    try:
        rows = await (log_.newest(limit) if newest else log_.read(since, limit))
    except ValueError as e:
        raise ServiceError(422, f"since: {e}") from None
    return CompletionsPage(run_id=run_id, rows=rows, next=rows[-1].id if rows else since)


@router.post("/runs/{run_id}/stop", response_model=RunRecord, summary="Stop a queued or running run")
async def stop_run(run_id: str, request: Request) -> RunRecord:
    """Another token's run needs the ``admin`` scope (403)."""
    runs = _state(request).runs
    _may_manage(request, f"run {run_id}", await runs.owner(run_id), "stopping")
    return await runs.stop(run_id)


def _errors(app: FastAPI) -> None:
    """Domain errors -> HTTP statuses, in one place."""

    @app.exception_handler(UnknownRun)
    async def _unknown(_r, e: UnknownRun) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": f"no run {e.args[0]}"})

    @app.exception_handler(RunConflict)
    async def _conflict(_r, e: RunConflict) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(e), "active_run": e.active_id})

    @app.exception_handler(TransitionError)
    async def _transition(_r, e: TransitionError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(e)})

    @app.exception_handler(ConfigError)
    async def _config(_r, e: ConfigError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(e)})

    @app.exception_handler(RedisError)
    async def _redis(_r, e: RedisError) -> JSONResponse:
        # the type only: a Redis error's text may name the server
        log.warning("control plane: Redis could not serve a request: %r", e)
        return JSONResponse(status_code=503, content={"detail": f"Redis unavailable ({type(e).__name__}); retry"},
                            headers={"Retry-After": str(REDIS_RETRY_AFTER_S)})


def build_app(settings: ControlSettings, config: RunConfig | None = None, *,
              start_learner: Callable[[str], Awaitable[None]] | None = None) -> FastAPI:
    """The control plane. Uses ``settings.redis_url``, else an embedded Redis in ``run_dir/redis``.

    ``config`` (``tandem serve control --config``) is the run config used
    when ``POST /v1/runs`` omits one. ``start_learner(run_id)``, when given, is awaited for each
    run once it is enqueued, and starts the run's learner (Modal spawns a learner job per run;
    ``tandem up`` and docker-compose keep a standing learner and pass none); it raises
    :class:`LearnerStartError` when it cannot.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        embedded = None if settings.redis_url else EmbeddedRedis(settings.run_dir / "redis").start()
        redis = connect(settings.redis_url or embedded.url, max_connections=REDIS_CONNECTIONS, wait_s=REDIS_WAIT_S,
                        retries=settings.redis_retries)
        app.state.redis = redis
        app.state.runs = RunStore(redis)
        app.state.functions = FunctionCheck(settings)
        app.state.prompt_sets = PromptSetStore(redis, settings, app.state.functions)
        app.state.trackers = TrackerHub(redis, settings.run_dir, mlflow_uris=settings.mlflow_tracking_uris).start()
        app.state.stalls = StallMonitor(redis).start()  # silent heartbeats become incidents
        try:
            yield
        finally:
            await app.state.stalls.stop()
            await app.state.trackers.stop()
            await app.state.functions.close()
            await redis.aclose()
            if embedded is not None:
                embedded.stop()

    async def health() -> bool:
        try:
            return bool(await app.state.redis.ping())
        except (RedisError, AttributeError, OSError):
            return False

    limit = max(settings.max_prompt_set_bytes, 1024)
    app = create_app(
        "tandem control plane",
        settings,
        lifespan=lifespan,
        health=health,
        body_limits={PROMPT_SETS_PATH: limit},
        cookie_login_path="/",
        session_max_age_s=settings.session_max_age_s,
    )
    app.state.default_config = config.model_dump(mode="json") if config is not None else None
    app.state.start_learner = start_learner
    _errors(app)
    app.include_router(router)
    app.include_router(dashboard_router)
    return app
