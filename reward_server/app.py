"""The reward server's HTTP API: ``POST /v1/score``, ``POST /v1/execute``, ``POST /v1/check``, ``GET /v1/sandbox``.

Rollout servers call ``/v1/score`` with the G completions of a group; anyone
may call ``/v1/execute`` to run a program in the sandbox; the control plane
asks ``/v1/check`` whether the python reward functions a prompt set names may
be called (``reward_server.verifiers.functions``). Both go through the
bounded execution queue (429 + Retry-After when full). Without a usable
sandbox, code execution is refused (503 on ``/v1/execute``,
``sandbox_error`` items in ``/v1/score``) unless ``unsafe_local`` is set;
the choice is logged at start-up and ``GET /v1/sandbox`` names it. Client-supplied limits above the server's
ceilings (``max_*`` settings) are refused with 422 naming the field.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CollectorRegistry

from reward_server.execution import ExecQueue, ceilings_of, refuse_over_ceilings, spec_limits
from reward_server.sandbox import choose
from reward_server.sandbox.base import Job, SandboxError, SandboxUnavailable, python_run
from reward_server.settings import RewardSettings
from reward_server.verifiers.functions import Functions, Runner
from reward_server.verifiers.judge import Judge
from reward_server.verifiers.math import MathVerifier
from reward_server.verifiers.reward_models import ModelRunner, RewardModels
from reward_server.verifiers.scorer import Scorer, sandbox_jobs
from services.app import ServiceError, create_app
from services.wire import (
    CheckFunctions,
    ExecuteRequest,
    ExecuteResult,
    FunctionsChecked,
    ScoreRequest,
    ScoreResponse,
)

log = logging.getLogger("tandem.reward")
router = APIRouter()


def _scorer(request: Request) -> Scorer:
    return request.app.state.scorer


@router.post("/v1/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    scorer = _scorer(request)
    specs = (found for i, item in enumerate(body.items) for found in spec_limits(item.spec, f"items.{i}.spec"))
    refuse_over_ceilings(specs, scorer.queue.ceilings)
    with scorer.queue.reserve(sum(sandbox_jobs(i.spec) for i in body.items)):
        return await scorer.score_all(body.items, body.trainer_state)


@router.post("/v1/check", response_model=FunctionsChecked)
async def check(body: CheckFunctions, request: Request) -> FunctionsChecked:
    functions, models = _scorer(request).functions, _scorer(request).models
    refused = await functions.check(body.functions, body.keywords) if body.functions else {}
    refused |= {name: why for name in body.models if (why := models.refusal(name)) is not None}
    known = functions.signatures()
    return FunctionsChecked(allowed={f: known[f] for f in body.functions if f not in refused}, refused=refused)


@router.get("/v1/sandbox")
async def sandbox(request: Request) -> dict:
    """Where code runs: the sandbox chosen at start-up, or why there is none (as logged then)."""
    queue = _scorer(request).queue
    return {"sandbox": request.app.state.sandbox_description,
            "isolated": queue.sandbox is not None and queue.sandbox.isolated}


@router.post("/v1/execute", response_model=ExecuteResult)
async def execute(body: ExecuteRequest, request: Request) -> ExecuteResult:
    queue = _scorer(request).queue
    if queue.sandbox is None:
        raise ServiceError(503, f"code execution is disabled: {queue.why_no_sandbox}; "
                                "set unsafe_local = true to run code without a sandbox")
    refuse_over_ceilings(iter([("limits", body.limits)]), queue.ceilings)
    files = {**body.files, "main.py": body.code}
    with queue.reserve(1):
        try:
            (outcome,) = await queue.run(Job(files=files, runs=[python_run(queue.sandbox.python, stdin=body.stdin)],
                                             limits=body.limits))
        except SandboxUnavailable as e:
            raise ServiceError(503, str(e)) from e
        except SandboxError as e:
            return ExecuteResult(status="sandbox_error", exit_code=None, stdout="", stderr=str(e)[:2000],
                                 wall_s=0.0, cpu_s=0.0, truncated=False)
    return ExecuteResult(status=outcome.status, exit_code=outcome.exit_code, stdout=outcome.stdout,
                         stderr=outcome.stderr, wall_s=outcome.wall_s, cpu_s=outcome.cpu_s,
                         truncated=outcome.truncated)


def build_app(settings: RewardSettings, config=None, functions_runner: Runner | None = None,
              models_runner: ModelRunner | None = None) -> FastAPI:
    """The reward server. ``config`` (a RunConfig) is accepted for ``tandem serve``; settings drive it.
    ``functions_runner``, ``models_runner``: where python reward functions and reward models run (default:
    worker processes here; on Modal, containers of their own)."""
    registry = CollectorRegistry()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sandbox, what = choose(settings)
        if sandbox is None:
            log.warning("reward server: NO SANDBOX (%s); code execution is refused "
                        "(set TANDEM_REWARD_UNSAFE_LOCAL=true to run code unsandboxed)", what)
        elif not sandbox.isolated:
            log.warning("reward server: %s", what)
        else:
            log.info("reward server: code runs in %s", what)
        queue = ExecQueue(sandbox, workers=settings.effective_workers, max_queued=settings.effective_max_queued,
                          registry=registry, why_no_sandbox=what if sandbox is None else "",
                          ceilings=ceilings_of(settings))
        math = MathVerifier(workers=settings.math_workers, timeout_s=settings.math_timeout_s)
        judge = Judge.from_settings(settings)
        functions = Functions(settings.functions, workers=settings.function_workers,
                              timeout_s=settings.function_timeout_s, runner=functions_runner)
        models = RewardModels(settings.models, device=settings.model_device, batch_size=settings.model_batch_size,
                              max_tokens=settings.model_max_tokens, timeout_s=settings.model_timeout_s,
                              runner=models_runner)
        if settings.functions:
            log.info("reward server: python reward functions allowed: %s", ", ".join(settings.functions))
        app.state.scorer = Scorer(queue, math, judge, registry, functions=functions, models=models,
                                  regex_timeout_s=settings.regex_timeout_s)
        app.state.sandbox_description = what
        if sandbox is not None:
            await sandbox.start()
        try:
            yield
        finally:
            await judge.close()
            await functions.close()
            await models.close()
            await math.close()
            if sandbox is not None:
                await sandbox.close()

    app = create_app("reward", settings, lifespan=lifespan, registry=registry)
    app.include_router(router)
    return app
