"""The python reward functions a prompt set names, checked with the reward server before anything is kept.

Who talks to whom: a ``python`` reward spec names a function the reward server must have installed and
allowed (``TANDEM_REWARD_FUNCTIONS``; ``reward_server.verifiers.functions``). The control plane cannot
know which, so when it has a reward server to ask (``TANDEM_CONTROL_REWARD_URL``: ``tandem up`` and
docker-compose set it) it asks that server's ``POST /v1/check``:

- at upload (``POST /v1/prompt-sets``): a line naming a function the reward server refuses makes the
  upload a 422 naming the line, the field and the reason, and nothing is stored;
- when a run is created (``POST /v1/runs``), for the specs as the run's config completes them (lines
  that name no type take ``reward.type``) in the training and held-out sets: the reward server's
  allow-list may have changed since the upload. A 422 again, before any group is enqueued.

Each check says which keywords the lines give the function besides TRL's own (their fields and ``args``), so
a function with a required parameter that no call would give is refused too, naming the parameter, at the
first line that lacks it. A ``reward_model`` spec's model is checked the same way: a name the reward server
does not list (``TANDEM_REWARD_MODELS``) is refused at the first line naming it. A reward server that cannot be reached makes either request a 503 (retry later),
never a silent pass.
Without ``TANDEM_CONTROL_REWARD_URL`` nothing is checked here: the reward server still refuses such a
function (a 422 on every ``/v1/score`` naming it), but only once rollouts are scored.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from control_plane.settings import ControlSettings
from services.app import ServiceError
from services.clients import RewardClient

CHECK_TIMEOUT_S = 30.0
"""The whole ``/v1/check`` call, retries included (a function's module is imported on its first check)."""
CHECK_BATCH = 256
"""Functions per ``/v1/check`` call (what ``services.wire.CheckFunctions`` takes)."""


Named = dict[tuple[str, tuple[str, ...] | None], tuple[int, str]]
"""(function, the keywords its call gives besides TRL's) -> (1-based line, field) of the first line naming it so;
a reward model is ``(its name, None)``."""


def _keywords(spec: dict) -> tuple[str, ...]:
    """The keywords a python spec's call gives besides TRL's: its ``args`` and its fields (``kwargs`` in the
    validated form, top-level keys in a line's own)."""
    names = {k for k in spec if k not in ("type", "function", "args", "kwargs")}
    for nested in ("args", "kwargs"):
        if isinstance(spec.get(nested), dict):
            names |= set(spec[nested])
    return tuple(sorted(names))


def spec_functions(spec: object, where: str = "") -> Iterator[tuple[str, str, tuple[str, ...] | None]]:
    """``(field path, function, keywords)`` of every python spec in a spec's JSON form (``parts.1.spec.function``),
    and ``(field path, model, None)`` of every reward model spec (``parts.0.spec.model``)."""
    if not isinstance(spec, dict):
        return
    if spec.get("type") == "python" and isinstance(spec.get("function"), str):
        yield f"{where}function", spec["function"], _keywords(spec)
    elif spec.get("type") == "reward_model" and isinstance(spec.get("model"), str):
        yield f"{where}model", spec["model"], None
    elif spec.get("type") == "combined" and isinstance(spec.get("parts"), list):
        for i, part in enumerate(spec["parts"]):
            if isinstance(part, dict):
                yield from spec_functions(part.get("spec"), f"{where}parts.{i}.spec.")


def line_functions(stored: dict, default_type: str) -> Iterator[tuple[str, str, tuple[str, ...] | None]]:
    """``(field, function, keywords)`` (a reward model's: ``(field, model, None)``) of a stored prompt-set line (``services.prompt_lines.check_line``'s form): a
    typed line's spec, or an untyped line's ``function`` field when it is checked as ``python``."""
    if "spec" in stored:
        yield from spec_functions(stored["spec"])
    elif default_type in ("python", "reward_model"):
        yield from spec_functions({"type": default_type, **stored.get("fields", {})})


class FunctionCheck:
    """Asks the reward server whether the functions named at given lines may be called, and the reward models
    named scored with."""

    def __init__(self, settings: ControlSettings) -> None:
        token = settings.reward_token or settings.token
        self.url = settings.reward_url
        self.client = (RewardClient(settings.reward_url, token.get_secret_value() if token else None,
                                    timeout_s=CHECK_TIMEOUT_S, attempts=3, max_total_s=CHECK_TIMEOUT_S)
                       if settings.reward_url else None)

    async def refusals(self, named: Named) -> list[dict]:
        """``{"line", "field", "msg"}`` for each function the reward server refuses, at the first line
        (1-based) and field that names it with those keywords; empty when all may be called or there is no
        server to ask. Raises a 503 :class:`ServiceError` when the reward server cannot be asked."""
        if self.client is None or not named:
            return []
        by_keywords: dict[tuple[str, ...], list[str]] = {}  # one check per set of keywords the lines give
        models = sorted(name for name, keywords in named if keywords is None)
        for function, keywords in sorted((k for k in named if k[1] is not None), key=str):
            by_keywords.setdefault(keywords, []).append(function)
        refused: dict[tuple[str, tuple[str, ...] | None], str] = {}
        try:
            for keywords, functions in by_keywords.items():
                for i in range(0, len(functions), CHECK_BATCH):
                    batch = functions[i:i + CHECK_BATCH]
                    answer = await self.client.check(batch, {f: list(keywords) for f in batch})
                    refused |= {(f, keywords): why for f, why in answer.refused.items()}
            for i in range(0, len(models), CHECK_BATCH):
                answer = await self.client.check([], models=models[i:i + CHECK_BATCH])
                refused |= {(name, None): why for name, why in answer.refused.items()}
        except httpx.HTTPError as e:
            names = list(dict.fromkeys(f for f, _ in sorted(named, key=str)))
            raise ServiceError(503, f"cannot ask the reward server ({self.url}) whether the python reward functions "
                                    f"and reward models {', '.join(names[:5])} may be used: {e}", retry_after=5) from None
        first: dict[str, dict] = {}  # a function refused whatever its keywords is named once, at its first line
        for key, why in sorted(refused.items(), key=lambda kv: (named[kv[0]][0], str(kv[0]))):
            first.setdefault(f"{key[0]}: {why}", {"line": named[key][0], "field": named[key][1], "msg": why})
        return sorted(first.values(), key=lambda e: e["line"])

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
