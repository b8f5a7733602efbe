"""Service settings: where a process listens and how it reaches the others.

Read from ``TANDEM_*`` environment variables (``REDIS_URL`` is honoured too,
as docker-compose and Modal set it). ``tandem serve`` flags override them.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", use_attribute_docstrings=True)

    token: SecretStr | None = None
    """Bearer token every route except /healthz requires (TANDEM_TOKEN). Unset: auth is off,
    allowed only on a loopback address."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on."""
    redis_url: str | None = Field(default=None, validation_alias=AliasChoices("REDIS_URL", "TANDEM_REDIS_URL"))
    """Redis to use; unset = start an embedded redis-server in the run directory."""
    run_dir: Path = Path("runs")
    """Where runs, weight versions and the embedded Redis data live."""
    run_id: str | None = None
    """The run a rollout server or learner works for (set by the supervisor or control plane)."""
    model: Path | None = None
    """Model directory for `tandem serve rollout --model DIR` without a run config."""
    server_id: str | None = None
    """Name of this process in metrics and the in-use registry (default: host:port)."""
    control_url: str = "http://127.0.0.1:8000"
    """Control plane base URL."""
    rollout_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8001"])
    """Rollout server base URLs (JSON list in the environment)."""
    reward_url: str = "http://127.0.0.1:8002"
    """Reward server base URL."""
    learner_url: str = "http://127.0.0.1:8003"
    """Learner base URL."""
    tokens: dict[str, list[Literal["read", "write"]]] = Field(default_factory=dict, repr=False)
    """Extra bearer tokens with scopes (TANDEM_TOKENS, JSON: {"token": ["read"]}). "read" allows
    GET/HEAD, "write" every other method; a token lacking the scope gets 403. TANDEM_TOKEN has both."""
    max_body_bytes: int = Field(default=64 << 20, ge=1024)
    """Requests larger than this get 413."""
    max_prompt_set_bytes: int = Field(default=64 << 20, ge=1024)
    """Control plane: prompt-set uploads larger than this get 413 (TANDEM_MAX_PROMPT_SET_BYTES)."""
    log_level: str = "info"
    """uvicorn log level."""

    def check_auth_safe(self) -> None:
        """Refuse to listen beyond loopback without a token."""
        if self.token is not None or self.tokens:
            return
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback:
            raise ValueError(f"TANDEM_TOKEN is unset: refusing to listen on {self.host} without auth")

    @property
    def name(self) -> str:
        return self.server_id or f"{self.host}:{self.port}"
