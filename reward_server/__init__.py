"""tandem's reward server: verifiers (math, format, code, judge) and sandboxed code execution.

``tandem serve reward`` calls :func:`serve`; tests and embedders use :func:`build_app`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from reward_server.settings import RewardSettings
    from reward_server.verifiers.functions import Runner
    from reward_server.verifiers.reward_models import ModelRunner


def build_app(settings: RewardSettings, config=None, functions_runner: Runner | None = None,
              models_runner: ModelRunner | None = None) -> FastAPI:
    from reward_server.app import build_app as _build

    return _build(settings, config, functions_runner, models_runner)


def serve(settings: RewardSettings, config=None) -> None:
    """Run the reward server in the foreground (blocks)."""
    from reward_server.app import build_app as _build
    from services.serving import serve as _serve

    _serve(_build(settings, config), settings)
