"""``judge`` reward: an LLM grades the completion through an OpenAI-compatible endpoint.

The prompt is the spec's template filled with ``{prompt}``, ``{completion}``
and ``{reference}``; it is sent to ``{url}/v1/chat/completions`` (temperature
0). The first match of ``score_pattern`` in the reply, divided by
``max_score`` and clipped to [0, 1], is the reward. An endpoint that fails
or a reply without a score is ``judge_error`` (infrastructure: no reward),
never a silent 0.
"""

from __future__ import annotations

import re

import httpx

from reward_server.verifiers.result import infra, scored
from services.wire import JudgeSpec, ScoreResult


class Judge:
    def __init__(self, default_url: str | None, api_key: str | None = None, timeout_s: float = 60.0,
                 max_tokens: int = 256) -> None:
        self.default_url = default_url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self.max_tokens = max_tokens

    def prompt(self, completion: str, spec: JudgeSpec) -> str:
        # str.replace, not str.format: braces in completions or references must stay literal.
        return (spec.template.replace("{prompt}", spec.prompt).replace("{reference}", spec.reference)
                .replace("{completion}", completion))

    async def score(self, item_id: str, completion: str, spec: JudgeSpec) -> ScoreResult:
        url = spec.url or self.default_url
        if not url:
            return infra(item_id, "judge_error", "no judge URL in the spec or the server settings")
        body = {
            "model": spec.model,
            "messages": [{"role": "user", "content": self.prompt(completion, spec)}],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        try:
            resp = await self.http.post(url.rstrip("/") + "/v1/chat/completions", json=body)
            resp.raise_for_status()
            reply = resp.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            return infra(item_id, "judge_error", f"judge request failed: {type(e).__name__}: {e}")
        try:
            match = re.search(spec.score_pattern, reply or "")
        except re.error as e:
            return infra(item_id, "judge_error", f"invalid score_pattern: {e}")
        if match is None:
            return infra(item_id, "judge_error", f"no score in the judge's reply: {str(reply)[:200]!r}")
        try:
            value = float(match.group(1) if match.groups() else match.group(0))
        except ValueError:
            return infra(item_id, "judge_error", f"score is not a number: {match.group(0)!r}")
        reward = min(1.0, max(0.0, value / spec.max_score))
        return scored(item_id, reward, "ok", f"judge score {value:g}/{spec.max_score:g}")

    async def close(self) -> None:
        await self.http.aclose()
