"""HTTP routes of the rollout server: ``/v1/generate`` and ``/v1/weights``.

Errors map to HTTP in one place each: a request the engine cannot serve is a
422 whose ``detail[0].loc`` names the field (the same shape as pydantic's own
422s from the app factory); more sequences than ``max_pending_seqs`` in
flight, a dead engine, or a reload that is draining too long are 503 with
``Retry-After``; a missing weight version is 404 and a corrupt one 422, and
the old weights keep serving.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError

from rollout_server.engine import Engine, EngineDead, InvalidRequest, Sampling
from rollout_server.settings import RolloutSettings
from rollout_server.transports import WeightLoadError
from services.app import ServiceError
from services.wire import GenerateRequest, GenerateResponse, LoadWeights, WeightsStatus

router = APIRouter()


def invalid(field: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", field), "msg": message, "type": "value_error"}])


class Pending:
    """Sequences of HTTP requests now in the engine, against ``max_pending_seqs``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seqs = 0


def _engine(request: Request) -> Engine:
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.alive:
        reason = engine.dead_reason if engine is not None else "engine not started"
        raise ServiceError(503, f"engine unavailable: {reason}", retry_after=5)
    return engine


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
        ids, field = engine.tokenize(body.prompt), "prompt"
    sampling = Sampling(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=body.max_tokens,
        stop=tuple(body.stop),
        seed=body.seed,
    )
    try:
        engine.check(ids, sampling, prompt_field=field)
    except InvalidRequest as e:
        raise invalid(e.field, e.message) from e

    pending: Pending = request.app.state.pending
    if pending.seqs + body.n > pending.limit:
        engine.metrics.requests.labels("http", "over_capacity").inc()
        raise ServiceError(
            503,
            f"over capacity: {pending.seqs} sequences in flight, limit {pending.limit}",
            retry_after=1,
        )
    pending.seqs += body.n
    engine.metrics.pending_seqs.set(pending.seqs)
    try:
        gen = await engine.generate(ids, sampling, source="http")
    except InvalidRequest as e:
        raise invalid(e.field, e.message) from e
    except EngineDead as e:
        raise ServiceError(503, f"engine unavailable: {e}", retry_after=5) from e
    finally:
        pending.seqs -= body.n
        engine.metrics.pending_seqs.set(pending.seqs)
    out = GenerateResponse(
        prompt_token_ids=gen.prompt_token_ids, samples=gen.samples, logprobs_mode=engine.logprobs_mode
    )
    # serialise directly: the samples were validated when built, a second pass through
    # FastAPI's response validation costs time per token for nothing
    return Response(out.model_dump_json(), media_type="application/json")


@router.get("/v1/weights", response_model=WeightsStatus)
async def weights(request: Request) -> WeightsStatus:
    return _engine(request).status()


@router.post(
    "/v1/weights",
    response_model=WeightsStatus,
    responses={404: {"description": "no weights at uri"}, 422: {"description": "corrupt or unfit weights"}},
)
async def load_weights(body: LoadWeights, request: Request) -> WeightsStatus:
    engine = _engine(request)
    try:
        return await engine.load_weights(body)
    except WeightLoadError as e:
        raise ServiceError(e.status, e.message) from e
    except EngineDead as e:
        raise ServiceError(503, f"engine unavailable: {e}", retry_after=5) from e
