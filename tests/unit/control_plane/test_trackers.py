"""The trackers' naming and checks (control_plane/trackers.py) without a control plane: metric names by
source, the config flattened into hyperparameters, the [logging] section's validation, and a tracker
library that is not installed refusing `tandem run` before anything starts. The trackers themselves,
in the real control plane, are tested in tests/integration/control_plane/test_trackers.py."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from control_plane.trackers import (
    TRACKERS,
    TrackerError,
    check_mlflow_uri,
    flatten,
    group_of,
    preflight,
    tracker_dir,
)
from deploy.cli import app
from services.config import ConfigError, parse_run_config
from tests.fixtures.control import run_config


def test_metric_groups_by_source():
    assert group_of("learner") == "train" and group_of("eval") == "eval"
    assert group_of("rollout:rollout") == "rollout" and group_of("rollout:rollout-2") == "rollout-2"
    assert group_of("rollout:10.0.0.5:8001") == "10.0.0.5_8001"  # a server id that is host:port


def test_the_config_flattens_to_dotted_hyperparameters():
    flat = flatten(parse_run_config(run_config(logging={"trackers": ["tensorboard"]})).model_dump(mode="json"))
    assert flat["learner.lr"] == 1e-5 and flat["sampling.group_size"] == 4 and flat["loss.filter_zero_variance"] is True
    assert flat["logging.trackers"] == '["tensorboard"]' and flat["eval.max_prompts"] == "null"
    assert flat["learner.betas"] == "[0.9, 0.999]"


def test_logging_section_is_checked_at_load():
    assert TRACKERS == ("tensorboard", "wandb", "mlflow")
    with pytest.raises(ConfigError, match="logging.trackers.0"):
        parse_run_config(run_config(logging={"trackers": ["tensorbored"]}))
    with pytest.raises(ConfigError, match="names a tracker twice"):
        parse_run_config(run_config(logging={"trackers": ["wandb", "wandb"]}))
    with pytest.raises(ConfigError, match="logging.wandb_mod"):
        parse_run_config(run_config(logging={"wandb_mod": "offline"}))
    with pytest.raises(ConfigError, match="publish.keep_best needs eval.every"):
        parse_run_config(run_config(publish={"keep_best": 1}))


def test_tracker_files_go_under_the_run_directory_and_never_outside(tmp_path):
    root = tmp_path.resolve()
    cfg = parse_run_config(run_config())
    assert tracker_dir(cfg, tmp_path, "r1") == root / "r1" / "trackers"
    cfg = parse_run_config(run_config(logging={"dir": "shared"}))
    assert tracker_dir(cfg, tmp_path, "r1") == root / "shared"
    cfg = parse_run_config(run_config(logging={"dir": str(root / "a" / "b")}))  # absolute, under it
    assert tracker_dir(cfg, tmp_path, "r1") == root / "a" / "b"
    (tmp_path / "link").symlink_to("/etc")
    for outside in ("/data/trackers", "../elsewhere", "a/../../elsewhere", "link/x"):
        cfg = parse_run_config(run_config(logging={"dir": outside}))
        with pytest.raises(TrackerError, match="logging.dir: .* is outside the control plane's run directory"):
            tracker_dir(cfg, tmp_path, "r1")


def test_an_mlflow_uri_must_be_one_the_operator_listed():
    cfg = parse_run_config(run_config(logging={"mlflow_tracking_uri": "http://mlflow:5000/"}))
    check_mlflow_uri(cfg, ["http://mlflow:5000"])  # up to a trailing slash
    for allowed in ([], ["http://mlflow:5001"]):
        with pytest.raises(TrackerError, match="logging.mlflow_tracking_uri: http://mlflow:5000/ is not one of"):
            check_mlflow_uri(cfg, allowed)
    check_mlflow_uri(parse_run_config(run_config()), [])  # unset: the local store, always allowed


def test_a_tracker_library_that_is_not_installed_stops_tandem_run_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # the import system's mark of a module that is not there
    with pytest.raises(TrackerError, match="mlflow not installed"):
        preflight(parse_run_config(run_config(logging={"trackers": ["tensorboard", "mlflow"]})))
    config = tmp_path / "run.toml"
    config.write_text(f'name = "t"\n[model]\npath = "{tmp_path / "no-model"}"\n[data]\ntrain = "t.jsonl"\n'
                      f'eval = "e.jsonl"\n[logging]\ntrackers = ["mlflow"]\n')
    result = CliRunner().invoke(app, ["run", str(config), "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 1, result.output
    assert "tandem run failed: logging.trackers: mlflow not installed" in result.output
    assert not (tmp_path / "runs").exists()  # no stack was started
