"""Typed HTTP clients between services, with the one retry policy.

Retries live here, as pure predicates: retry transport errors, timeouts,
429 and 5xx (honouring ``Retry-After``), never another 4xx: a 4xx means the
request is wrong and repeating it cannot help. :func:`is_retryable` is also
what a caller asks once the client's own attempts are spent (the rollout
actor: leave the prompt for a later delivery, or dead-letter it).

A whole call, every attempt and back-off together, is bounded by
``max_total_s`` (the rollout server's reward client: ``watchdog.score_s``): a
server that accepts the connection and never answers costs at most that,
then a retryable ``httpx.TimeoutException`` naming the bound, logged and
recorded as an incident (``services.watchdog``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable

import httpx
from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_base, wait_exponential_jitter

from services import watchdog, wire
from services.security import CLIENT_HEADER


def is_retryable(exc: BaseException) -> bool:
    """True for failures a later attempt may not repeat: transport errors, timeouts, 429, 5xx."""
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return code == 429 or 500 <= code <= 599
    return isinstance(exc, httpx.TransportError)  # connect/read errors and timeouts


def retry_after_s(exc: BaseException | None) -> float | None:
    """The server's ``Retry-After`` in seconds, if the failure carries one."""
    if isinstance(exc, httpx.HTTPStatusError):
        value = exc.response.headers.get("retry-after", "")
        try:
            return max(0.0, float(value))
        except ValueError:
            return None
    return None


class _wait_retry_after(wait_base):
    """Exponential back-off with jitter, but at least the server's Retry-After."""

    def __init__(self, max_s: float) -> None:
        self.backoff = wait_exponential_jitter(multiplier=0.2, max=max_s, jitter=0.2)
        self.max_s = max_s

    def __call__(self, retry_state) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        hinted = retry_after_s(exc)
        return min(self.max_s, max(self.backoff(retry_state), hinted or 0.0))


class ServiceClient:
    """Base client: bearer auth, per-attempt timeout, bounded retries, a bound on the whole call.

    Every request carries :data:`~services.security.CLIENT_HEADER`, which tells a service with auth
    off that a body-less POST (``stop_run``) comes from a client, not from a web page."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        attempts: int = 5,
        max_total_s: float = 300.0,
        bound_field: str = "max_total_s",
        incidents: watchdog.IncidentSink | None = None,
        source: str = "",
    ) -> None:
        headers = {CLIENT_HEADER: "tandem"} | ({"Authorization": f"Bearer {token}"} if token else {})
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.attempts = attempts
        self.max_total_s = max_total_s
        self.bound_field = bound_field
        """The setting ``max_total_s`` comes from, named in the timeout's message (``watchdog.score_s``)."""
        self.incidents = incidents
        """Where a call that ran out of ``max_total_s`` is recorded (a run's ``IncidentLog``), besides the log."""
        self.source = source

    async def request(self, method: str, path: str, body: BaseModel | dict | None = None) -> httpx.Response:
        """One call, all attempts together bounded by ``max_total_s``: a server that accepts the
        connection and never answers costs at most that (``httpx.TimeoutException``, retryable)."""
        payload = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
        t0 = time.monotonic()
        try:
            # tenacity's stop_after_delay is checked between attempts only; the timeout is the bound
            async with asyncio.timeout(self.max_total_s):
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception(is_retryable),
                    stop=stop_after_attempt(self.attempts) | stop_after_delay(self.max_total_s),
                    wait=_wait_retry_after(max_s=10.0),
                    reraise=True,
                ):
                    with attempt:
                        resp = await self.http.request(method, path, json=payload)
                        resp.raise_for_status()
        except TimeoutError:
            url = f"{self.http.base_url}{path}"
            inc = watchdog.incident(
                f"{method} {path}", f"{url} (attempts of {self.http.timeout.read:g} s each)",
                waited_s=time.monotonic() - t0, limit_s=self.max_total_s, field=self.bound_field,
                action="retryable failure: the caller retries later", source=self.source,
            )
            await watchdog.report(inc, self.incidents)
            raise httpx.TimeoutException(watchdog.message(inc), request=httpx.Request(method, url)) from None
        return resp

    async def healthy(self) -> bool:
        try:
            return (await self.http.get("/healthz", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RewardClient(ServiceClient):
    async def score(self, request: wire.ScoreRequest) -> wire.ScoreResponse:
        resp = await self.request("POST", "/v1/score", request)
        return wire.ScoreResponse.model_validate(resp.json())

    async def execute(self, request: wire.ExecuteRequest) -> wire.ExecuteResult:
        resp = await self.request("POST", "/v1/execute", request)
        return wire.ExecuteResult.model_validate(resp.json())

    async def check(self, functions: list[str], keywords: dict[str, list[str]] | None = None,
                    models: list[str] | None = None) -> wire.FunctionsChecked:
        """Which of these python reward functions the reward server may call (``POST /v1/check``), their calls
        giving ``keywords[function]`` besides TRL's own, and which of these reward models it lists."""
        resp = await self.request("POST", "/v1/check", wire.CheckFunctions(functions=functions, keywords=keywords or {},
                                                                            models=models or []))
        return wire.FunctionsChecked.model_validate(resp.json())


class RolloutClient(ServiceClient):
    async def generate(self, request: wire.GenerateRequest) -> wire.GenerateResponse:
        resp = await self.request("POST", "/v1/generate", request)
        return wire.GenerateResponse.model_validate(resp.json())

    async def weights(self) -> wire.WeightsStatus:
        resp = await self.request("GET", "/v1/weights")
        return wire.WeightsStatus.model_validate(resp.json())

    async def load_weights(self, request: wire.LoadWeights) -> wire.WeightsStatus:
        resp = await self.request("POST", "/v1/weights", request)
        return wire.WeightsStatus.model_validate(resp.json())


class ControlClient(ServiceClient):
    async def upload_prompt_set(
        self, data: bytes | AsyncIterable[bytes], default_type: str = "math"
    ) -> wire.PromptSetInfo:
        """Upload JSON lines: ``data`` whole, or its chunks as they are produced (sent chunked: a
        dataset import streams). One attempt: a 4xx names the bad line (the request is wrong), and
        a stream cannot be replayed."""
        resp = await self.http.post(
            "/v1/prompt-sets", content=data, params={"default_type": default_type},
            headers={"Content-Type": "application/x-ndjson"},
        )
        resp.raise_for_status()
        return wire.PromptSetInfo.model_validate(resp.json())

    async def prompt_sets(self) -> list[wire.PromptSetInfo]:
        resp = await self.request("GET", "/v1/prompt-sets")
        return [wire.PromptSetInfo.model_validate(p) for p in resp.json()]

    async def prompt_set(self, set_id: str) -> wire.PromptSetInfo:
        resp = await self.request("GET", f"/v1/prompt-sets/{set_id}")
        return wire.PromptSetInfo.model_validate(resp.json())

    async def delete_prompt_set(self, set_id: str) -> wire.PromptSetInfo:
        resp = await self.request("DELETE", f"/v1/prompt-sets/{set_id}")
        return wire.PromptSetInfo.model_validate(resp.json())

    async def create_run(self, prompt_set_id: str, config: dict | None,
                         eval_prompt_set_id: str | None = None, client_run_dir: str | None = None) -> wire.RunCreated:
        resp = await self.request("POST", "/v1/runs", wire.CreateRun(
            prompt_set_id=prompt_set_id, config=config, eval_prompt_set_id=eval_prompt_set_id,
            client_run_dir=client_run_dir))
        return wire.RunCreated.model_validate(resp.json())

    async def run_status(self, run_id: str) -> wire.RunStatus:
        resp = await self.request("GET", f"/v1/runs/{run_id}")
        return wire.RunStatus.model_validate(resp.json())

    async def runs(self) -> list[wire.RunRecord]:
        resp = await self.request("GET", "/v1/runs")
        return [wire.RunRecord.model_validate(r) for r in resp.json()]

    async def metrics(self, run_id: str) -> list[wire.MetricPoint]:
        """Every point of the run's metrics, oldest first."""
        return await self._every(f"/v1/runs/{run_id}/metrics", wire.MetricsPage, "points")

    async def completions(self, run_id: str) -> list[wire.CompletionRow]:
        """Every row of the run's completions table still kept, oldest first."""
        return await self._every(f"/v1/runs/{run_id}/completions", wire.CompletionsPage, "rows")

    async def _every(self, path: str, page_type: type[wire.Wire], field: str) -> list:
        """The ``field`` items of every page of ``path``, each page read after the previous one's ``next``."""
        items, since = [], None
        while True:
            page = page_type.model_validate((await self.request("GET", path + (f"?since={since}" if since else ""))).json())
            items += getattr(page, field)
            if page.next is None or not getattr(page, field):
                return items
            since = page.next

    async def stop_run(self, run_id: str) -> wire.RunRecord:
        resp = await self.request("POST", f"/v1/runs/{run_id}/stop")
        return wire.RunRecord.model_validate(resp.json())
