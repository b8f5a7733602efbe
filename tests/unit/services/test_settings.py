"""Settings read only their own variables: bare names change nothing, misspelt TANDEM_* ones fail."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from deploy.cli import app, settings_classes
from services.settings import PREFIX, SettingsError, check_environment, env_names

CLASSES = settings_classes()


def clean_env(monkeypatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith(PREFIX) or name == "REDIS_URL":
            monkeypatch.delenv(name)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_bare_names_change_nothing(name, monkeypatch):
    """SEED, DTYPE, MODEL, ... (every field's bare name, of every class) leave every class at its defaults."""
    clean_env(monkeypatch)
    default = CLASSES[name]().model_dump()
    bare = {f.upper() for cls in CLASSES.values() for f in cls.model_fields} | {"SEED", "DTYPE", "MODEL"}
    bare.discard("REDIS_URL")  # the one documented name outside the prefix
    for variable in bare:
        monkeypatch.setenv(variable, "1")  # read, it would change a value or fail validation
    assert CLASSES[name]().model_dump() == default


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_each_field_is_read_under_its_declared_name_only(name, monkeypatch):
    """TANDEM_CONTROL_PORT does not set the control plane's port (TANDEM_PORT does), and so on."""
    clean_env(monkeypatch)
    cls = CLASSES[name]
    default = cls().model_dump()
    declared = env_names(cls)
    prefixes = {PREFIX, cls.model_config.get("env_prefix", ""), *(f"{PREFIX}{n.upper()}_" for n in CLASSES)}
    for field in cls.model_fields:
        for prefix in prefixes:
            if f"{prefix}{field}".upper() not in declared:
                monkeypatch.setenv(f"{prefix}{field}".upper(), "1")
    assert cls().model_dump() == default
    for variable in declared:
        assert variable.startswith(PREFIX) or variable == "REDIS_URL", variable
    if name == "rollout":
        monkeypatch.setenv("TANDEM_ROLLOUT_MAX_N", "3")
        monkeypatch.setenv("TANDEM_PORT", "9123")
        assert (cls().max_n, cls().port) == (3, 9123)


def test_a_misspelt_variable_is_an_error_naming_the_closest_valid_one():
    known = CLASSES.values()
    check_environment(known, {"TANDEM_ROLLOUT_SEED": "1", "TANDEM_TOKEN": "x", "SEED": "1"})
    with pytest.raises(SettingsError, match=r"TANDEM_ROLLOUT_SED: unknown setting \(did you mean TANDEM_ROLLOUT_SEED\?\)"):
        check_environment(known, {"TANDEM_ROLLOUT_SED": "1"})
    with pytest.raises(SettingsError, match="TANDEM_SANDBOX.*did you mean TANDEM_REWARD_SANDBOX"):
        check_environment(known, {"TANDEM_SANDBOX": "bwrap"})


def test_the_cli_refuses_to_start_with_a_misspelt_variable(monkeypatch):
    clean_env(monkeypatch)
    monkeypatch.setenv("TANDEM_ROLLOUT_KV_CACHE_GBI", "1")
    out = CliRunner().invoke(app, ["serve", "rollout", "--model", "/nonexistent"])
    assert out.exit_code == 2
    assert "TANDEM_ROLLOUT_KV_CACHE_GBI: unknown setting (did you mean TANDEM_ROLLOUT_KV_CACHE_GIB?)" in out.output


def test_tandem_config_prints_effective_settings_with_secrets_masked(monkeypatch):
    clean_env(monkeypatch)
    monkeypatch.setenv("TANDEM_TOKEN", "very-secret-token")
    monkeypatch.setenv("TANDEM_TOKENS", json.dumps({"viewer-secret": ["read"]}))
    monkeypatch.setenv("REDIS_URL", "redis://user:redis-password@example:6379/0")
    monkeypatch.setenv("TANDEM_REWARD_JUDGE_API_KEY", "judge-secret")
    monkeypatch.setenv("TANDEM_ROLLOUT_MAX_N", "7")
    out = CliRunner().invoke(app, ["config"])
    assert out.exit_code == 0, out.output
    for secret in ("very-secret-token", "viewer-secret", "redis-password", "judge-secret"):
        assert secret not in out.output
    shown = json.loads(out.output)
    assert set(shown) == set(CLASSES)
    assert shown["rollout"]["max_n"] == 7 and shown["reward"]["sandbox"] == "auto"
    assert shown["control"]["redis_url"] == "redis://**********@example:6379/0"
    one = CliRunner().invoke(app, ["config", "rollout"])
    assert json.loads(one.output)["max_n"] == 7


def test_a_broadcast_host_beyond_loopback_needs_a_token(monkeypatch):
    """Without TANDEM_TOKEN the weight groups' key is public: only loopback may host them."""
    from pydantic import SecretStr, ValidationError

    from learner.settings import LearnerSettings

    clean_env(monkeypatch)
    LearnerSettings(broadcast_host="127.0.0.1")
    LearnerSettings(broadcast_host="10.1.2.3", token=SecretStr("a-long-enough-token-for-tests"))
    with pytest.raises(ValidationError, match="TANDEM_LEARNER_BROADCAST_HOST=10.1.2.3 needs TANDEM_TOKEN"):
        LearnerSettings(broadcast_host="10.1.2.3")
