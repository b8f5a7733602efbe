"""HTTP routes of the rollout server: ``/v1/generate`` and ``/v1/weights``.

Errors map to HTTP in one place each: a request the engine cannot serve is a
422 whose ``detail[0].loc`` names the field (the same shape as pydantic's own
422s from the app factory); more sequences than ``max_pending_seqs`` in
flight, a dead engine, or a reload that is draining too long are 503 with
``Retry-After``; a missing weight version is 404 and a corrupt one 422, and
the old weights keep serving.

``POST /v1/weights`` loads only what the learner published (the operator's
token is needed, but a wrong or forged announcement must not be able to
stall training by loading version 10^12, nor read files beyond the store):
``sha256`` is required (422); the path, resolved, must lie under the weight
store, the run directory (403, :func:`~rollout_server.transports.confine`);
a version not newer than the one served is a no-op, as in the engine; any
other must be in the run's weight registry in Redis with that very path and
checksum (403 naming the field). The run is ``TANDEM_RUN_ID``, else the
newest run in the registry (the one the stack serves, or just finished).
Without Redis there is no registry and the route answers 409.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError

from broker import Keys, WeightRegistry, WeightVersion, connect
from broker.ledger import Ledger
from rollout_server.engine import Generation, RolloutEngine, Sampling
from rollout_server.episodes import EpisodeGeneration, run_episodes
from rollout_server.errors import EngineDead, InvalidRequest
from rollout_server.settings import RolloutSettings
from rollout_server.tools import ToolBox
from rollout_server.transports import WeightLoadError, confine
from services import weightstore
from services.app import ServiceError
from services.runs import RunStore
from services.wire import EpisodeSpec, GenerateRequest, GenerateResponse, LoadWeights, WeightsStatus

log = logging.getLogger("tandem.rollout")

router = APIRouter()


def invalid(field: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", field), "msg": message, "type": "value_error"}])


class Pending:
    """Sequences of HTTP requests now in the engine, against ``max_pending_seqs``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seqs = 0


def _engine(request: Request) -> RolloutEngine:
    engine: RolloutEngine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.alive:
        reason = engine.dead_reason if engine is not None else "engine not started"
        raise ServiceError(503, f"engine unavailable: {reason}", retry_after=5)
    return engine


async def run_generation(request: Request, ids: list[int], sampling: Sampling, *, prompt_field: str,
                         episode: EpisodeSpec | None = None) -> Generation:
    """Generate for one HTTP request (``/v1/generate`` and the OpenAI routes of ``openai_api``): what the
    engine cannot serve is a 422 naming the field, sequences beyond ``max_pending_seqs`` a 503. With
    ``episode``, ``sampling.n`` episodes with the app's tools (``app.state.tools``)."""
    engine = _engine(request)
    try:
        engine.check(ids, sampling, prompt_field=prompt_field)
    except InvalidRequest as e:
        raise invalid(e.field, e.message) from e
    pending: Pending = request.app.state.pending
    if pending.seqs + sampling.n > pending.limit:
        engine.metrics.requests.labels("http", "over_capacity").inc()
        raise ServiceError(
            503,
            f"over capacity: {pending.seqs} sequences in flight, limit {pending.limit}",
            retry_after=1,
        )
    pending.seqs += sampling.n
    engine.metrics.pending_seqs.set(pending.seqs)
    try:
        if episode is None:
            return await engine.generate(ids, sampling, source="http")
        return await run_episodes(engine, ids, sampling, episode, sampling.n, request.app.state.tools)
    except InvalidRequest as e:
        raise invalid(e.field, e.message) from e
    except EngineDead as e:
        raise ServiceError(503, f"engine unavailable: {e}", retry_after=5) from e
    finally:
        pending.seqs -= sampling.n
        engine.metrics.pending_seqs.set(pending.seqs)


@router.post(
    "/v1/generate",
    response_model=GenerateResponse,
    responses={422: {"description": "invalid request; detail[].loc names the field"},
               503: {"description": "over capacity or engine down; see Retry-After"}},
)
async def generate(body: GenerateRequest, request: Request) -> Response:
    settings: RolloutSettings = request.app.state.settings
    engine = _engine(request)
    if body.n > settings.max_n:
        raise invalid("n", f"n={body.n} is above this server's maximum of {settings.max_n}")
    if body.prompt_token_ids is not None:
        ids, field = list(body.prompt_token_ids), "prompt_token_ids"
    else:
        field = "messages" if body.messages is not None else "prompt"
        try:
            _, ids = engine.prompt_ids(body.prompt, body.messages, body.chat_template_kwargs)
        except InvalidRequest as e:
            raise invalid(e.field, e.message) from e
    tools: ToolBox = request.app.state.tools
    if body.episode is not None and (unknown := tools.unknown(body.episode.tools)):
        raise invalid("episode.tools", f"this server has no tool {unknown[0]!r}")
    sampling = Sampling(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=body.max_tokens,
        stop=tuple(body.stop),
        seed=body.seed,
    )
    gen = await run_generation(request, ids, sampling, prompt_field=field, episode=body.episode)
    out = GenerateResponse(
        prompt_token_ids=gen.prompt_token_ids, samples=gen.samples, logprobs_mode=engine.logprobs_mode,
        last_turns=gen.texts if isinstance(gen, EpisodeGeneration) else None,
    )
    # serialise directly: the samples were validated when built, a second pass through
    # FastAPI's response validation costs time per token for nothing
    return Response(out.model_dump_json(), media_type="application/json")


@router.get("/v1/weights", response_model=WeightsStatus)
async def weights(request: Request) -> WeightsStatus:
    return _engine(request).status()


async def published(settings: RolloutSettings, version: int) -> tuple[str, WeightVersion]:
    """The run whose registry speaks for this server, and its record of ``version`` (403/409 otherwise)."""
    if not settings.redis_url:
        raise ServiceError(409, "version: this server has no weight registry (REDIS_URL unset); "
                                "it loads only versions a learner published there")
    redis = connect(settings.redis_url)
    try:
        run_id = settings.run_id
        if run_id is None:
            newest = await RunStore(redis).list(1)
            if not newest:
                raise ServiceError(403, f"version: {version} was not published: the registry holds no run")
            run_id = newest[0].run_id
        registry = WeightRegistry(redis, Keys(run_id))
        record = await registry.get(version)
        if record is None:
            raise ServiceError(403, f"version: {version} was not published in run {run_id} "
                                    f"(newest published: {await registry.latest_version()})")
        if version in await registry.retracted():
            raise ServiceError(403, f"version: {version} of run {run_id} was retracted (published after the "
                                    "checkpoint a resumed learner restored)")
        return run_id, record
    except RedisError as e:
        raise ServiceError(503, f"weight registry unavailable: {e}", retry_after=5) from e
    finally:
        await redis.aclose()


@router.post(
    "/v1/weights",
    response_model=WeightsStatus,
    responses={403: {"description": "outside the weight store, or not published; detail names the field"},
               404: {"description": "no weights at uri"}, 409: {"description": "no weight registry"},
               422: {"description": "sha256 missing, or corrupt or unfit weights"}},
)
async def load_weights(body: LoadWeights, request: Request) -> WeightsStatus:
    settings: RolloutSettings = request.app.state.settings
    engine = _engine(request)
    if body.sha256 is None:
        raise invalid("sha256", "required: the checksum the learner published with this version")
    try:
        path = confine(body.uri, Path(settings.run_dir))
    except WeightLoadError as e:
        raise ServiceError(e.status, e.message) from e
    if body.version <= engine.version:
        return engine.status()  # not newer: a no-op, as RolloutEngine.load_weights; nothing is read
    run_id, record = await published(settings, body.version)
    if weightstore.uri_to_path(record.uri).resolve() != path:
        raise ServiceError(403, f"uri: version {body.version} of run {run_id} was published at {record.uri}, "
                                f"not {body.uri}")
    if record.sha256 != body.sha256:
        raise ServiceError(403, f"sha256: {body.sha256} is not the checksum version {body.version} of run "
                                f"{run_id} was published with")
    try:
        # recorded by the swap's own task: a request cancelled at the swap (the client gone) still leaves its record
        return await engine.load_weights(LoadWeights(version=body.version, uri=str(path), sha256=body.sha256),
                                         record=functools.partial(_record_loaded, settings, run_id, body.version,
                                                                  body.sha256))
    except WeightLoadError as e:
        raise ServiceError(e.status, e.message) from e
    except EngineDead as e:
        raise ServiceError(503, f"engine unavailable: {e}", retry_after=5) from e


async def _record_loaded(settings: RolloutSettings, run_id: str, version: int, sha256: str) -> None:
    """The ledger's ``loaded`` entry for a version loaded over HTTP (best effort: the load stands)."""
    redis = connect(settings.redis_url)
    try:
        await Ledger(redis, Keys(run_id)).append("loaded", server=settings.name, version=version, sha256=sha256)
    except RedisError as e:
        log.warning("version %d loaded; its ledger entry was not written: %s", version, e)
    finally:
        await redis.aclose()
