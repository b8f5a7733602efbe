"""Run config: the examples validate; mistakes are errors that name the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import ConfigError, load_run_config, parse_run_config
from services.settings import CommonSettings

ROOT = Path(__file__).resolve().parents[3]
MINIMAL = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}


@pytest.mark.parametrize("path", sorted(ROOT.glob("examples/*/run.toml")), ids=lambda p: p.parent.name)
def test_examples_are_valid(path):
    config = load_run_config(path)
    assert config.model.path.is_absolute()
    assert config.data.train.is_absolute()
    # a data file either ships with the example or is made on first use under runs/ by its make_data.py
    made_on_first_use = ROOT / "runs" in config.data.train.parents and (path.parent / "make_data.py").exists()
    assert config.data.train.exists() or made_on_first_use, f"{path}: data.train {config.data.train} is missing"


def test_there_is_an_example():
    assert list(ROOT.glob("examples/*/run.toml"))


def test_unknown_key_names_file_and_field(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\npath = "m"\n[data]\ntrain = "t"\n[loss]\neps_hihg = 0.3\n')
    with pytest.raises(ConfigError, match=r"run\.toml: loss\.eps_hihg: unknown field; did you mean eps_high\?$"):
        load_run_config(f)


def test_an_unknown_key_like_no_field_lists_its_sections_fields():
    with pytest.raises(ConfigError, match=r"learner\.lora\.xyzzy: unknown field; remove it \(learner\.lora has: r, "
                                          r"alpha, dropout, target_modules\)$"):
        parse_run_config({**MINIMAL, "learner": {"lora": {"xyzzy": 1}}})
    with pytest.raises(ConfigError, match=r": xyzzy: unknown field; remove it \(the top level has: name, model, "):
        parse_run_config({**MINIMAL, "xyzzy": 1})


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"sampling\.group_size: .*integer"):
        parse_run_config({**MINIMAL, "sampling": {"group_size": "eight"}})
    with pytest.raises(ConfigError, match=r"sampling\.group_size: .*greater than or equal to 2"):
        parse_run_config({**MINIMAL, "sampling": {"group_size": 1}})


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"staleness": {"max_staleness": 0}, "publish": {"every": 2}}, "publish.every = 1"),
        ({"sampling": {"max_tokens": 600}, "model": {"path": "m", "max_model_len": 512}}, "max_model_len"),
        ({"loss": {"eps_low": 0.3, "eps_high": 0.2}}, "eps_high must be >= loss.eps_low"),
        ({"learner": {"offload_params": True, "zero_stage": 2}}, "zero_stage = 3"),
        ({"name": "bad name!"}, "run id"),
    ],
)
def test_inconsistent_fields_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({**MINIMAL, **extra})


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_run_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(bad)


def test_every_field_is_documented():
    from services.config import RunConfig, Section

    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            ann = field.annotation
            for sub in (ann, *getattr(ann, "__args__", ())):
                if isinstance(sub, type) and issubclass(sub, Section):
                    walk(sub)

    walk(RunConfig)


def test_service_settings_from_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_PORT", "9123")
    monkeypatch.setenv("TANDEM_TOKEN", "s3cret")
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    s = CommonSettings()
    assert (s.port, s.token.get_secret_value(), s.redis_url) == (9123, "s3cret", "redis://example:6379/0")


def test_no_token_only_on_loopback():
    CommonSettings(host="127.0.0.1").check_auth_safe()
    with pytest.raises(ValueError, match="refusing"):
        CommonSettings(host="0.0.0.0").check_auth_safe()
    CommonSettings(host="0.0.0.0", token="t" * 16).check_auth_safe()


@pytest.mark.parametrize("sampling, refused", [
    ({}, None),
    ({"temperature": 0.7}, "sampling.temperature = 0.7"),
    ({"top_k": 5}, "sampling.top_k = 5"),
    ({"top_p": 0.9}, "sampling.top_p = 0.9"),
    ({"min_tokens": 4}, "sampling.min_tokens = 4"),
])
def test_raw_logprobs_describe_only_unprocessed_sampling(sampling, refused):
    """raw_logprobs are the sampled distribution only when nothing processes the logits;
    processed_logprobs always are (services.config.SamplingConfig.logprobs_refusal)."""
    from services.config import SamplingConfig

    cfg = SamplingConfig(**sampling)
    assert cfg.logprobs_refusal("processed_logprobs") is None
    why = cfg.logprobs_refusal("raw_logprobs")
    assert why is None if refused is None else refused in why and "TANDEM_ROLLOUT_LOGPROBS_MODE" in why
