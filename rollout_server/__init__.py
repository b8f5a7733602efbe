"""The rollout server: vLLM as a long-lived HTTP service and GRPO actor.

One process, one vLLM engine (``AsyncLLM``), serving

- ``POST /v1/generate``: samples with the sampled tokens' log-probabilities
  and the weight version that produced them (``api``), or episodes with the
  server's tools (``episodes``: held-out evaluation of episode lines);
- ``GET/POST /v1/weights``: the loaded version; load a published version in
  place (``reload``, ``transports``);
- OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``,
  and vLLM's ``/inference/v1/generate``, with token ids, log-probs and weight
  versions in every answer (``openai_api``); ``verifiers_env`` turns a
  verifiers environment's episodes against them into training groups;
- the actor loop when started for a run: prompt groups from the broker under
  admission control, scored by the reward server, handed to the learner as
  trajectory groups (``actor``).

Modules: ``settings`` (``TANDEM_ROLLOUT_*``), ``engine`` (vLLM lifecycle,
generation), ``rendering`` (tokenizer, chat template), ``errors``, ``reload`` (a
new version from its arrival to the engine serving it), ``transports`` (how
weights reach the engine), ``worker_ext`` (in vLLM's workers), ``api`` and
``openai_api`` (routes), ``verifiers_env``, ``actor`` (the loop), ``metrics``,
``app`` (factory, lifespan, watchdog, ``serve``). vLLM is imported only when
the engine starts, so importing this package is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rollout_server.settings import RolloutSettings
    from services.config import RunConfig


def build_app(settings: RolloutSettings, config: RunConfig | None = None, **kw) -> FastAPI:
    from rollout_server.app import build_app as _build

    return _build(settings, config, **kw)


def serve(settings: RolloutSettings, config: RunConfig | None = None) -> None:
    from rollout_server.app import serve as _serve

    _serve(settings, config)


__all__ = ["build_app", "serve"]
