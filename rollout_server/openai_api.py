"""OpenAI-compatible routes of the rollout server, backed by its engine; and vLLM's token-in route.

- ``POST /v1/chat/completions`` and ``POST /v1/completions`` take OpenAI's request shapes (model,
  messages or prompt, max_tokens, temperature, top_p, n, stop, seed, logprobs, stream, tools), so an
  evaluation harness or an environment library (``verifiers``) drives the policy being trained with
  the OpenAI client it already uses. Beside OpenAI's fields every answer carries what training needs
  and OpenAI has no field for: each choice's ``token_ids`` (the ids the engine sampled, exactly), the
  behaviour log-probability of each (``logprobs``, always given, in OpenAI's shape; the engine's
  ``logprobs_mode``, as ``/v1/generate``) and its ``weight_version``; the response's
  ``prompt_token_ids`` (the ids the model read: messages rendered with the model's own chat template,
  as ``/v1/generate`` renders them) and ``weight_version`` (the oldest of its choices'). A client can
  so build training data token-exactly, without re-tokenising text.
- ``POST /inference/v1/generate`` is vLLM's tokens-in, tokens-out route: the client renders the
  prompt itself and sends ``token_ids``; the answer holds the sampled ids and their log-probabilities
  (``"token_id:<id>"`` entries, vLLM's ``return_tokens_as_token_ids`` form). verifiers' train client
  (``TrainClientConfig``) speaks it; its traces then keep every turn's tokens exactly.
- ``GET /v1/models``: the one model served, with its ``max_model_len`` (vLLM's field, which
  verifiers' renderers read) and the weight version now loaded.

**Tool calls.** With ``tools`` in a chat request the tools are passed to the chat template, and
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in a completion (the Hermes
form that Qwen's templates teach) for a tool the request declared become the choice's
``message.tool_calls`` (finish reason ``tool_calls``); the text around them stays ``content``.
A block that is not such JSON, or names another tool, stays in ``content`` untouched.

**Streaming** (``stream: true``) sends each choice whole in one chunk once generation ends (the
engine returns finished sequences only), then the usage chunk if ``stream_options.include_usage``,
then ``[DONE]``: the shape OpenAI clients read, without token-by-token latency.

**Errors.** A bad field is a 422 whose body has OpenAI's ``error`` (``message``, ``type``,
``param`` naming the field) beside tandem's ``detail`` (``detail[0].loc``, as every route);
a model this server does not serve is a 404 (``param: "model"``); over capacity and a dead engine
are 503 with ``Retry-After``, as ``/v1/generate``. What the engine cannot do is refused, not
ignored: penalties, ``logit_bias``, top alternatives (``top_logprobs``, completions' ``logprobs``
above 0), ``echo``, ``suffix``, forced tool choices. Auth is the app's (``services.security``):
the OpenAI client's ``api_key`` is the rollout server's token.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rollout_server.api import _engine, invalid, run_generation
from rollout_server.engine import RolloutEngine, Sampling
from rollout_server.errors import InvalidRequest
from rollout_server.rendering import render_chat
from rollout_server.settings import RolloutSettings
from services.app import ServiceError
from services.wire import ChatTemplateKwargs, Sample

MAX_STOP = 16


# -- errors in OpenAI's shape ------------------------------------------------------


def _error(status: int, message: str, *, param: str | None, code: str | None, kind: str,
           headers: dict[str, str] | None = None, detail: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    body["detail"] = message if detail is None else detail
    return JSONResponse(status_code=status, content=body, headers=headers)


def _param(loc: list | tuple) -> str | None:
    path = [str(p) for p in loc[1:]] if loc and loc[0] == "body" else [str(p) for p in loc]
    return ".".join(path) or None


class OpenAIRoute(APIRoute):
    """A route whose errors carry OpenAI's ``error`` object beside tandem's ``detail``."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as e:
                errors = [{"loc": list(x["loc"]), "msg": x["msg"], "type": x["type"]} for x in e.errors()]
                first = errors[0] if errors else {"loc": ["body"], "msg": "invalid request"}
                param = _param(first["loc"])
                return _error(422, f"{param or 'body'}: {first['msg']}", param=param, code=None,
                              kind="invalid_request_error", detail=errors)
            except ServiceError as e:
                headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after is not None else None
                param = "model" if e.status == 404 else None
                kind = "invalid_request_error" if e.status < 500 else "server_error"
                code = "model_not_found" if e.status == 404 else None
                return _error(e.status, e.message, param=param, code=code, kind=kind, headers=headers)
            except HTTPException as e:  # auth (401/403): the app's message, OpenAI's shape
                kind = "authentication_error" if e.status_code == 401 else "permission_error"
                return _error(e.status_code, str(e.detail), param=None, code=None, kind=kind,
                              headers=getattr(e, "headers", None))

        return route


router = APIRouter(route_class=OpenAIRoute)


# -- request shapes --------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """Parts of a message OpenAI clients echo back with fields of their own (``refusal``, ``annotations``)."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str = Field(min_length=1)
    arguments: str = "{}"


class ToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    """One message, OpenAI's shape; text content only (a string or text parts)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict:
        """The dict a Hugging Face chat template reads: content a string, ``developer`` as ``system``,
        tool-call arguments as objects (what Qwen's and most templates expect)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampled(_Strict):
    """Fields both OpenAI routes share."""

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM's extension; 0 or -1 = off.")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_tokens_as_token_ids: bool = Field(
        default=False, description="vLLM's extension: each logprobs entry's token is 'token_id:<id>'.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > MAX_STOP or any(not s for s in stops)):
            raise ValueError(f"at most {MAX_STOP} stop strings, none empty")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v:
            raise ValueError("penalties are not applied by this server; send 0 or leave it out")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not applied by this server; leave it out")
        return v

    def sampling(self, max_tokens: int) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return Sampling(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            max_tokens=max_tokens,
            stop=tuple(stops),
            seed=self.seed,
        )


class ChatRequest(_Sampled):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs = Field(default_factory=dict)

    @field_validator("messages")
    @classmethod
    def _answerable(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if v[-1].role == "assistant":
            raise ValueError("the last message is the assistant's: this server opens a new assistant turn "
                             "and does not continue one")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _sampled_only(cls, v):
        if v:
            raise ValueError("only the sampled token's log-probability is served (top_logprobs 0)")
        return v


class CompletionRequest(_Sampled):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, v):
        if v:
            raise ValueError("only the sampled token's log-probability is served (logprobs 0; always given)")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not served: the response's prompt_token_ids hold the prompt")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v is not None:
            raise ValueError("suffix (insertion) is not served")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n"):
            raise ValueError("only best_of = n is served (every sample is returned)")
        return v


class GenerateParams(_Strict):
    """``sampling_params`` of ``/inference/v1/generate`` (the subset of vLLM's that this server applies)."""

    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, description="Ignored: the sampled token's is always given.")
    skip_special_tokens: bool = Field(default=True, description="Ignored: the answer holds token ids, no text.")


class TokenGenerateRequest(_Strict):
    """``POST /inference/v1/generate``: vLLM's tokens-in request."""

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateParams = Field(default_factory=GenerateParams)
    cache_salt: str | None = Field(default=None, description="Ignored (one tenant).")
    priority: int | None = Field(default=None, description="Ignored.")


# -- routes ------------------------------------------------------------------------


def served_names(engine: RolloutEngine) -> tuple[str, ...]:
    """Names a request's ``model`` may give: the model directory's name (what ``/v1/models`` lists) or its path."""
    return (engine.model_dir.name, str(engine.model_dir))


def _check_model(engine: RolloutEngine, model: str | None) -> None:
    if model is not None and model not in served_names(engine):
        raise ServiceError(404, f"model: this server serves {engine.model_dir.name!r}, not {model!r}")


def _check_n(request: Request, n: int) -> None:
    settings: RolloutSettings = request.app.state.settings
    if n > settings.max_n:
        raise invalid("n", f"n={n} is above this server's maximum of {settings.max_n}")


def _room(engine: RolloutEngine, ids: list[int]) -> int:
    return max(engine.max_model_len - len(ids), 1)


def _piece(engine: RolloutEngine, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else engine.tokenizer.decode([token])


def _usage(prompt: list[int], samples: list[Sample]) -> dict:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def _answer(kind: str, model: str, prompt_ids: list[int], samples: list[Sample], choices: list[dict],
            engine: RolloutEngine) -> dict:
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(prompt_ids, samples),
        "prompt_token_ids": prompt_ids,
        "weight_version": min(s.policy_version for s in samples),
        "logprobs_mode": engine.logprobs_mode,
    }


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a completion: each ``<tool_call>{"name", "arguments"}</tool_call>`` block
    that names a declared tool becomes a call (arguments as a JSON string, OpenAI's form); the rest of
    the text, stripped, is the content (``None`` when nothing is left)."""
    names = {t.function.name for t in tools}
    calls, kept, last = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        args = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def _chat_choice(engine: RolloutEngine, body: ChatRequest, i: int, s: Sample) -> dict:
    content, calls = s.text, []
    if body.tools and body.tool_choice != "none":
        content, calls = parse_tool_calls(s.text, body.tools)
    finish = "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    entries = []
    for t, lp in zip(s.token_ids, s.logprobs, strict=True):
        piece = _piece(engine, t, body.return_tokens_as_token_ids)
        entries.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
    return {"index": i, "message": message, "finish_reason": finish, "logprobs": {"content": entries},
            "token_ids": s.token_ids, "weight_version": s.policy_version}


def _completion_choice(engine: RolloutEngine, body: CompletionRequest, i: int, s: Sample) -> dict:
    pieces = [_piece(engine, t, body.return_tokens_as_token_ids) for t in s.token_ids]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"index": i, "text": s.text, "finish_reason": s.finish_reason,
            "logprobs": {"tokens": pieces, "token_logprobs": s.logprobs, "top_logprobs": None, "text_offset": offsets},
            "token_ids": s.token_ids, "weight_version": s.policy_version}


def _sse(events: list[dict]) -> StreamingResponse:
    async def lines():
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def _stream(answer: dict, body: _Sampled, chunk_kind: str, delta: Callable[[dict], dict]) -> StreamingResponse:
    """``answer`` as server-sent events: one chunk per choice, then usage (if asked for)."""
    head = {k: answer[k] for k in ("id", "created", "model", "prompt_token_ids", "weight_version")}
    events = [{**head, "object": chunk_kind, "choices": [delta(c)]} for c in answer["choices"]]
    if body.stream_options is not None and body.stream_options.include_usage:
        events.append({**head, "object": chunk_kind, "choices": [], "usage": answer["usage"]})
    return _sse(events)


def _chat_delta(choice: dict) -> dict:
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
    return {k: v for k, v in choice.items() if k != "message"} | {"delta": delta}


@router.post(
    "/v1/chat/completions",
    responses={404: {"description": "a model this server does not serve"},
               422: {"description": "invalid request; error.param and detail[].loc name the field"},
               503: {"description": "over capacity or engine down; see Retry-After"}},
)
async def chat_completions(body: ChatRequest, request: Request):
    engine = _engine(request)
    _check_model(engine, body.model)
    _check_n(request, body.n)
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs)
    if body.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        _, ids = render_chat(engine.tokenizer, [m.for_template() for m in body.messages], kwargs, engine.model_dir)
    except InvalidRequest as e:
        raise invalid(e.field, e.message) from e
    max_tokens = body.max_completion_tokens or body.max_tokens or _room(engine, ids)
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    try:
        gen = await run_generation(request, ids, body.sampling(max_tokens), prompt_field="messages")
    except RequestValidationError as e:  # the engine names max_tokens whichever of the two was sent
        raise _renamed(e, "max_tokens", field) from e
    choices = [_chat_choice(engine, body, i, s) for i, s in enumerate(gen.samples)]
    answer = _answer("chat.completion", body.model, gen.prompt_token_ids, gen.samples, choices, engine)
    if body.stream:
        return _stream(answer, body, "chat.completion.chunk", _chat_delta)
    return JSONResponse(answer)


def _renamed(e: RequestValidationError, old: str, new: str) -> RequestValidationError:
    if old == new:
        return e
    return RequestValidationError([{**x, "loc": tuple(new if p == old else p for p in x["loc"])} for x in e.errors()])


@router.post(
    "/v1/completions",
    responses={404: {"description": "a model this server does not serve"},
               422: {"description": "invalid request; error.param and detail[].loc name the field"},
               503: {"description": "over capacity or engine down; see Retry-After"}},
)
async def completions(body: CompletionRequest, request: Request):
    engine = _engine(request)
    _check_model(engine, body.model)
    _check_n(request, body.n)
    ids = engine.tokenize(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    gen = await run_generation(request, ids, body.sampling(body.max_tokens), prompt_field="prompt")
    choices = [_completion_choice(engine, body, i, s) for i, s in enumerate(gen.samples)]
    answer = _answer("text_completion", body.model, gen.prompt_token_ids, gen.samples, choices, engine)
    if body.stream:
        return _stream(answer, body, "text_completion", lambda c: c)
    return JSONResponse(answer)


@router.post(
    "/inference/v1/generate",
    responses={404: {"description": "a model this server does not serve"},
               422: {"description": "invalid request; error.param and detail[].loc name the field"},
               503: {"description": "over capacity or engine down; see Retry-After"}},
)
async def generate_tokens(body: TokenGenerateRequest, request: Request) -> JSONResponse:
    engine = _engine(request)
    _check_model(engine, body.model)
    sp = body.sampling_params
    _check_n(request, sp.n)
    ids = list(body.token_ids)
    sampling = Sampling(n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
                        max_tokens=sp.max_tokens or _room(engine, ids), stop=tuple(sp.stop),
                        stop_token_ids=tuple(sp.stop_token_ids), seed=sp.seed)
    gen = await run_generation(request, ids, sampling, prompt_field="token_ids")
    choices = [
        {"index": i, "token_ids": s.token_ids, "finish_reason": s.finish_reason, "weight_version": s.policy_version,
         "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(s.token_ids, s.logprobs,
                                                                                            strict=True)]}}
        for i, s in enumerate(gen.samples)
    ]
    return JSONResponse({
        "request_id": f"gen-{uuid.uuid4().hex}",
        "prompt_token_ids": gen.prompt_token_ids,
        "choices": choices,
        "usage": _usage(gen.prompt_token_ids, gen.samples),
        "weight_version": min(s.policy_version for s in gen.samples),
        "logprobs_mode": engine.logprobs_mode,
    })


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    engine = _engine(request)
    card = {"id": engine.model_dir.name, "object": "model", "created": 0, "owned_by": "tandem",
            "root": str(engine.model_dir), "max_model_len": engine.max_model_len, "weight_version": engine.version}
    return JSONResponse({"object": "list", "data": [card]})
