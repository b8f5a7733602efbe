"""tandem's reward server: verifiers (math, format, code, judge) and sandboxed code execution.

``tandem serve reward`` calls :func:`serve`; tests and embedders use :func:`build_app`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from services.settings import ServiceSettings


def build_app(settings: ServiceSettings, config=None) -> FastAPI:
    from reward_server.app import build_app as _build

    return _build(settings, config)


def serve(settings: ServiceSettings, config=None) -> None:
    """Run the reward server in the foreground (blocks)."""
    from reward_server.app import build_app as _build
    from reward_server.settings import RewardSettings
    from services.app import serve as _serve

    # Reward-specific settings come from TANDEM_* variables; the CLI's host/port win.
    reward = RewardSettings(**{k: v for k, v in settings.model_dump().items() if k in settings.model_fields_set})
    _serve(_build(reward, config), reward)
