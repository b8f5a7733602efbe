"""Settings of the entry points: the local stack's supervisor (``TANDEM_STACK_*``) and the CLI as a client.

Like every process's settings class, these live in the package of the process that reads them;
``services.settings`` holds only what several processes share.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from services.settings import PREFIX, CommonSettings, EnvByNameOnce, settings_config


class StackSettings(CommonSettings):
    """The supervisor of the local stack (`tandem up`, `tandem run`): ``TANDEM_STACK_*``."""

    model_config = settings_config(PREFIX + "STACK_")

    max_restarts: int = Field(default=3, ge=0)
    """Restarts of a crashed service (with back-off) before the stack fails (TANDEM_STACK_MAX_RESTARTS)."""
    restart_backoff_s: float = Field(default=2.0, ge=0)
    """Seconds before a crashed service's first restart, doubled for each further restart, at most 30
    (TANDEM_STACK_RESTART_BACKOFF_S)."""
    stop_grace_s: float = Field(default=15.0, ge=0)
    """Seconds a service gets to exit after SIGTERM before its process group is killed
    (TANDEM_STACK_STOP_GRACE_S)."""
    rollouts: int = Field(default=1, ge=1, le=16)
    """Rollout servers to start (TANDEM_STACK_ROLLOUTS): ``rollout``, ``rollout-2``, ... each its own
    vLLM engine; they share the run's admission capacity."""
    learner_ranks: int = Field(default=1, ge=1, le=64)
    """Learner ranks (TANDEM_STACK_LEARNER_RANKS): more than 1 starts the learner under ``torchrun``
    (gloo on CPU, DeepSpeed ZeRO across the ranks)."""


class ClientSettings(BaseSettings):
    """The CLI as a client of a control plane (`tandem submit`, `tandem status`)."""

    model_config = settings_config(PREFIX)

    url: str | None = None
    """Control plane URL (TANDEM_URL; `--url` wins). Unset: the local stack's `stack.json`, else
    http://127.0.0.1:8000."""
    token: SecretStr | None = None
    """Bearer token for the control plane (TANDEM_TOKEN)."""
    redis_url: SecretStr | None = Field(default=None, validation_alias="REDIS_URL")
    """`tandem audit RUN_ID` reads the run's ledger there. Unset: the local stack's `stack.json`."""
    run_dir: Path = Field(default=Path("runs"), validation_alias="TANDEM_RUN_DIR")
    """This machine's folder that a deployment's run directory mirrors (TANDEM_RUN_DIR; default ``runs``,
    from where `modal volume put` uploads models): `tandem submit` sends it, and a control plane that
    cannot see the run's model.path looks for it at the same place under its own run directory."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, EnvByNameOnce(settings_cls)  # REDIS_URL only, not TANDEM_REDIS_URL
