"""The control plane: ``tandem serve control``.

REST API (``app``), prompt-set validation and storage (``prompt_sets``), the
prompt groups a run enqueues (``groups``) and the browser dashboard
(``dashboard``). The run registry it shares with the learner and rollout
servers is ``services.runs``.
"""

from __future__ import annotations

from control_plane.settings import ControlSettings
from services.config import RunConfig


def build_app(settings: ControlSettings, config: RunConfig | None = None, **hooks):
    """The control plane's FastAPI app (see ``control_plane.app.build_app``; ``hooks``: its
    ``start_learner``)."""
    from control_plane.app import build_app as _build

    return _build(settings, config, **hooks)


def serve(settings: ControlSettings, config: RunConfig | None = None) -> None:
    """Run the control plane in the foreground (``tandem serve control``)."""
    from services.serving import serve as _serve

    _serve(build_app(settings, config), settings)


__all__ = ["build_app", "serve"]
