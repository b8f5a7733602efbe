"""Service settings: how a process listens and how it reaches the others.

One class per process, each in the ``settings`` module of the process's own package; this
module holds only what they share (:class:`CommonSettings`, :class:`WorkerSettings`, the
environment check). Each class reads its own environment variables:

| class | process | variables |
|---|---|---|
| :class:`CommonSettings` | every service | ``TANDEM_TOKEN``, ``TANDEM_TOKENS``, ``TANDEM_OPENAI_TOKEN``, ``TANDEM_HOST``, ``TANDEM_PORT``, ``TANDEM_LOG_LEVEL``, ``TANDEM_MAX_BODY_BYTES``, ``TANDEM_RUN_DIR``, ``TANDEM_ALLOWED_HOSTS``, ``REDIS_URL`` |
| :class:`WorkerSettings` | what a rollout server and the learner share | ``TANDEM_RUN_ID``, ``TANDEM_SERVER_ID`` |
| ``ControlSettings`` | control plane (``control_plane.settings``) | ``TANDEM_CONTROL_*`` |
| ``RolloutSettings`` | rollout server (``rollout_server.settings``) | ``TANDEM_ROLLOUT_*`` |
| ``RewardSettings`` | reward server (``reward_server.settings``) | ``TANDEM_REWARD_*`` |
| ``LearnerSettings`` | learner (``learner.settings``) | ``TANDEM_LEARNER_*`` |
| ``StackSettings`` | the supervisor (``tandem up``, ``tandem run``; ``deploy.settings``) | ``TANDEM_STACK_*`` |
| ``ClientSettings`` | the CLI as a client (``tandem submit``, ``status``; ``deploy.settings``) | ``TANDEM_URL``, ``TANDEM_TOKEN`` |

``REDIS_URL`` is the one name outside the ``TANDEM_`` prefix (the name Redis
hosts, docker-compose and Modal Secrets use). No other variable is read: a
bare ``SEED`` or ``DTYPE`` changes nothing, and :func:`check_environment`
refuses a ``TANDEM_*`` variable that no class declares, naming the closest
valid one (the CLI calls it at start-up with every class).
``tandem config`` prints the effective settings with secrets masked.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

PREFIX = "TANDEM_"
MIN_TOKEN_CHARS = 16
"""Shortest bearer token a service starts with (TANDEM_TOKEN and each of TANDEM_TOKENS)."""


def settings_config(prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(env_prefix=prefix, extra="forbid", use_attribute_docstrings=True,
                              populate_by_name=True)


class EnvByNameOnce(EnvSettingsSource):
    """The environment, each field read under one name: its alias if it has one, else prefix + name.

    ``populate_by_name`` (so that code and tests can pass ``token=...``) would otherwise make the
    environment source read a field under both names: ``TANDEM_CONTROL_PORT`` as well as ``TANDEM_PORT``.
    """

    def _extract_field_info(self, field, field_name, model_config=None):
        return super()._extract_field_info(field, field_name, {**(model_config or self.config), "populate_by_name": False})


class SettingsError(ValueError):
    """The environment names a variable no settings class reads."""


class CommonSettings(BaseSettings):
    """What every service reads: ``TANDEM_*`` without a process prefix, and ``REDIS_URL``.

    Each field names its variable (``validation_alias``), so a subclass's prefix applies only
    to the subclass's own fields."""

    model_config = settings_config(PREFIX)

    token: SecretStr | None = Field(default=None, validation_alias="TANDEM_TOKEN")
    """Bearer token every route except /healthz requires (TANDEM_TOKEN). Unset: auth is off,
    allowed only on a loopback address."""
    tokens: dict[str, list[Literal["read", "submit", "infer", "admin", "write"]]] = Field(
        default_factory=dict, repr=False, validation_alias="TANDEM_TOKENS")
    """Extra bearer tokens with scopes (TANDEM_TOKENS, JSON: {"token": ["read", "submit"]}). "read"
    allows GET/HEAD; "submit" uploading prompt sets and starting runs, and deleting or stopping those the
    same token made; "infer" the rollout server's inference routes (/v1/generate, the OpenAI-compatible
    ones); "admin" everything, others' prompt sets and runs included. "write", the old name, now means
    "submit" and "infer". A token lacking the scope gets 403. TANDEM_TOKEN has every scope."""
    openai_token: SecretStr | None = Field(default=None, validation_alias="TANDEM_OPENAI_TOKEN")
    """Bearer token with the "infer" scope only (TANDEM_OPENAI_TOKEN): the OpenAI-compatible endpoint's
    key (the OpenAI client's `api_key`), which cannot submit, stop or read runs, nor load weights."""
    host: str = Field(default="127.0.0.1", validation_alias="TANDEM_HOST")
    """Address to listen on (TANDEM_HOST; `tandem serve --host` wins)."""
    port: int = Field(default=8000, ge=0, le=65535, validation_alias="TANDEM_PORT")
    """Port to listen on (TANDEM_PORT; `tandem serve --port` wins)."""
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        default="info", validation_alias="TANDEM_LOG_LEVEL")
    """Log level (TANDEM_LOG_LEVEL)."""
    max_body_bytes: int = Field(default=64 << 20, ge=1024, validation_alias="TANDEM_MAX_BODY_BYTES")
    """Requests larger than this get 413 (TANDEM_MAX_BODY_BYTES)."""
    run_dir: Path = Field(default=Path("runs"), validation_alias="TANDEM_RUN_DIR")
    """Where runs, weight versions and the embedded Redis data live (TANDEM_RUN_DIR)."""
    run_dir_volume: str | None = Field(default=None, validation_alias="TANDEM_RUN_DIR_VOLUME")
    """Name of the Modal Volume mounted at the run directory (TANDEM_RUN_DIR_VOLUME; set by
    deploy/modal_app.py): the learner commits it after writing a weight version and a rollout
    server reloads it before reading one. Unset (local disk, docker volumes): neither."""
    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL")
    """Redis to use (REDIS_URL); unset = start an embedded redis-server in the run directory."""
    allowed_hosts: list[str] | None = Field(default=None, validation_alias="TANDEM_ALLOWED_HOSTS")
    """Host headers this service answers (TANDEM_ALLOWED_HOSTS, JSON list; an entry is a name, any
    port, or name:port). Unset: with auth off, the loopback names only (localhost, 127.0.0.1,
    [::1]), so a DNS-rebound page gets 403; with auth on, any Host (a rebound page lacks the token).
    Set: checked with auth on too (a reverse proxy's public name, docker-compose service names)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, EnvByNameOnce(settings_cls)  # no .env file, no secrets directory

    @property
    def auth_on(self) -> bool:
        """True when a token is configured (an empty TANDEM_TOKEN counts as none)."""
        return bool(self.token and self.token.get_secret_value()) or bool(self.tokens) or self.openai_token is not None

    def check_auth_safe(self) -> None:
        """Refuse a short token (:meth:`check_tokens`), and to listen beyond loopback without one
        (an empty TANDEM_TOKEN is no token)."""
        if not self.auth_on:
            try:
                loopback = ipaddress.ip_address(self.host).is_loopback
            except ValueError:
                loopback = self.host == "localhost"
            if not loopback:
                raise ValueError(f"TANDEM_TOKEN is unset: refusing to listen on {self.host} without auth")
        self.check_tokens()

    def check_tokens(self) -> None:
        """Refuse a token shorter than :data:`MIN_TOKEN_CHARS` (an empty ``TANDEM_TOKEN=""`` included).

        A service calls it at start-up (``services.app.create_app``): a short token is guessable,
        and an empty one used to switch auth off while passing the loopback guard."""
        if self.token is not None and len(self.token.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"TANDEM_TOKEN is {len(self.token.get_secret_value())} characters: use at least "
                f"{MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`), "
                "or unset it to run without auth on a loopback address"
            )
        short = [i for i, t in enumerate(self.tokens) if len(t) < MIN_TOKEN_CHARS]
        if short:
            raise ValueError(f"TANDEM_TOKENS: token #{short[0]} is shorter than {MIN_TOKEN_CHARS} characters")
        if self.openai_token is not None and len(self.openai_token.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"TANDEM_OPENAI_TOKEN is shorter than {MIN_TOKEN_CHARS} characters")

    def scoped_tokens(self) -> dict[str, list[str]]:
        """``tokens`` with ``openai_token`` added under the ``infer`` scope (what ``services.app`` accepts
        beside ``token``)."""
        extra = {self.openai_token.get_secret_value(): ["infer"]} if self.openai_token is not None else {}
        return {**self.tokens, **extra}

    def masked(self) -> dict[str, Any]:
        """The effective settings as JSON-able values, secrets (tokens, keys, passwords in URLs) masked."""
        out = self.model_dump(mode="json")
        if self.tokens:
            out["tokens"] = {f"**********{i}": scopes for i, scopes in enumerate(self.tokens.values())}
        if self.redis_url and "@" in self.redis_url:
            scheme, rest = self.redis_url.split("://", 1) if "://" in self.redis_url else ("", self.redis_url)
            out["redis_url"] = f"{scheme}://**********@{rest.rsplit('@', 1)[1]}"
        return out


class WorkerSettings(CommonSettings):
    """What a rollout server and the learner share: which run they work for, and their name."""

    run_id: str | None = Field(default=None, validation_alias="TANDEM_RUN_ID")
    """The run this process works for (TANDEM_RUN_ID). Unset: follow whichever run the control
    plane activates (`tandem up`, docker-compose)."""
    server_id: str | None = Field(default=None, validation_alias="TANDEM_SERVER_ID")
    """Name of this process in metrics and the in-use registry (TANDEM_SERVER_ID; default host:port)."""

    @property
    def name(self) -> str:
        return self.server_id or f"{self.host}:{self.port}"


def env_names(cls: type[BaseSettings]) -> set[str]:
    """The environment variables ``cls`` reads."""
    prefix = cls.model_config.get("env_prefix", "")
    names = set()
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        names.add(alias if isinstance(alias, str) else f"{prefix}{name}".upper())
    return names


def check_environment(classes: Iterable[type[BaseSettings]], environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SettingsError` for each ``TANDEM_*`` variable none of ``classes`` reads.

    The CLI passes every process's class: a variable of another process is fine (docker-compose
    and ``tandem up`` give one environment to several processes); a misspelt one is not, since it
    would be silently ignored.
    """
    environ = os.environ if environ is None else environ
    known = set().union(*(env_names(c) for c in classes))
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    if unknown:
        lines = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            lines.append(f"{name}: unknown setting" + (f" (did you mean {close[0]}?)" if close else ""))
        raise SettingsError("; ".join(lines) + " — `tandem config` lists every setting")
