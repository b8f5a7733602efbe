"""What the rollout engine raises to its callers, besides a version it refuses (``transports.WeightLoadError``).

The HTTP routes (``api``, ``openai_api``) map them to status codes, the actor to a dead letter or its
own end. Their own module because the engine's parts raise them alike: generation and the chat
template (``engine``, ``rendering``) an :class:`InvalidRequest`, generation and a reload (``reload``)
:class:`EngineDead`.
"""

from __future__ import annotations


class EngineDead(Exception):
    """The vLLM engine process died; the server must restart."""


class InvalidRequest(Exception):
    """A generate request the engine cannot serve; ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
