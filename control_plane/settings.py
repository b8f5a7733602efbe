"""Settings of the control plane process (``TANDEM_CONTROL_*`` on top of ``services.settings``).

The run config says what a run trains; these settings say how much a client may store and where the
control plane checks reward functions. Like every process's settings class, it lives in the process's
own package; ``services.settings`` holds only what several processes share.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from services.settings import PREFIX, CommonSettings, settings_config


class ControlSettings(CommonSettings):
    """The control plane (`tandem serve control`): ``TANDEM_CONTROL_*``."""

    model_config = settings_config(PREFIX + "CONTROL_")

    max_prompt_set_bytes: int = Field(default=64 << 20, ge=1024)
    """Prompt-set uploads larger than this get 413 (TANDEM_CONTROL_MAX_PROMPT_SET_BYTES)."""
    max_prompt_set_lines: int = Field(default=1_000_000, ge=1)
    """Prompt sets with more non-blank lines than this get 422 (TANDEM_CONTROL_MAX_PROMPT_SET_LINES)."""
    max_prompt_line_bytes: int = Field(default=8 << 20, ge=1024)
    """A prompt-set line longer than this gets 422 naming it (TANDEM_CONTROL_MAX_PROMPT_LINE_BYTES)."""
    max_stored_prompt_set_bytes: int = Field(default=1 << 30, ge=1024)
    """Stored bytes of all prompt sets together; an upload past it gets 507, naming the setting
    (TANDEM_CONTROL_MAX_STORED_PROMPT_SET_BYTES)."""
    reward_url: str | None = None
    """Reward server asked (``POST /v1/check``) whether the python reward functions a prompt set names may be
    called, so that an upload or a run naming one it refuses gets 422 before anything is stored or trained
    (TANDEM_CONTROL_REWARD_URL; `tandem up` and docker-compose set it). Unset: not checked here, and the
    reward server refuses such a function only when completions are scored."""
    fleet_model: Path | None = None
    """The model folder every rollout server of this deployment serves (TANDEM_CONTROL_FLEET_MODEL; the
    Modal app sets it to its run config's model): a run whose ``model.path``, as the deployment sees it,
    is another gets 422 naming this one (a rollout server serves only runs of the model it loaded, so
    such a run would never train). Unset: any model is accepted."""
    reward_token: SecretStr | None = None
    """Bearer token for that reward server (TANDEM_CONTROL_REWARD_TOKEN). Unset: TANDEM_TOKEN."""
    redis_retries: int = Field(default=30, ge=0)
    """Attempts a request makes to reach Redis again after a lost connection, with a back-off of 0.1 s
    doubling to 1 s: the default (``broker.streams.RECONNECT_RETRIES``, about 25 s) rides out a Redis
    restarted on its AOF; past them the request is answered 503 with Retry-After
    (TANDEM_CONTROL_REDIS_RETRIES)."""
    model_dirs: list[Path] = Field(default_factory=list)
    """Folders besides the run directory that a run's ``model.path`` may lie in (TANDEM_CONTROL_MODEL_DIRS,
    JSON list; symlinks and ``..`` resolved before the check). Empty (the default): the run directory only,
    and a path elsewhere gets 422 without being looked at, so a submitter learns nothing of the control
    plane's disk. ``tandem up`` and ``tandem run`` set ``["/"]`` unless it is set: their one client is the
    operator, on the same disk."""
    mlflow_tracking_uris: list[str] = Field(default_factory=list)
    """MLflow tracking URIs a run's ``logging.mlflow_tracking_uri`` may name (TANDEM_CONTROL_MLFLOW_TRACKING_URIS,
    JSON list, compared up to a trailing slash). Empty (the default): none, and a run logs to MLflow's SQLite
    store under its tracker directory; a run naming another URI gets 422 naming the field (its config
    comes from whoever may submit, and MLflow would connect to any URL or open an SQLite file anywhere)."""
    session_max_age_s: int = Field(default=12 * 3600, ge=60, le=30 * 24 * 3600)
    """Lifetime of the dashboard's read-only session cookie (``GET /?token=T``) in seconds: its
    Max-Age, and the age past which the server refuses it (TANDEM_CONTROL_SESSION_MAX_AGE_S)."""
