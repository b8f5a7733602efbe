"""bench/e2e.py without TRL or a stack: the run config it writes, the accuracy timing, the CPU accounting."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench/e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tandem_config_is_the_example_with_this_benchmarks_settings(e2e, tmp_path):
    from services.config import load_run_config

    base = load_run_config(ROOT / "examples/arith/run.toml")
    cfg = load_run_config(e2e.tandem_config("25m", tmp_path / "m", 20, 5, tmp_path))
    assert cfg.model.path == tmp_path / "m" and cfg.model.bootstrap is None
    assert (cfg.learner.steps, cfg.eval.every, cfg.loss.filter_zero_variance) == (20, 5, False)
    # everything else as in the example: the two sides' hyperparameters come from there
    assert cfg.sampling == base.sampling and cfg.learner.lr == base.learner.lr
    assert cfg.loss == base.loss  # the example trains every group too, as TRL does
    assert load_run_config(e2e.tandem_config("example", tmp_path / "m", 150, 10, tmp_path)).loss == base.loss


def test_time_to_accuracy_is_the_first_eval_point_that_reaches_it(e2e):
    points = [{"step": 20, "accuracy": 0.91, "train_s": 30.0}, {"step": 0, "accuracy": 0.6, "train_s": 0.0},
              {"step": 10, "accuracy": 0.75, "train_s": 14.0}, {"step": 30, "accuracy": 0.88, "train_s": 44.0}]
    assert e2e.first_reaching(points, 0.7) == 14.0
    assert e2e.first_reaching(points, 0.9) == 30.0
    assert e2e.first_reaching(points, 0.95) is None


def test_a_descendants_cpu_time_is_counted_while_it_runs(e2e):
    before = e2e.tree_cpu_s(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 1.0: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while e2e.tree_cpu_s(os.getpid()) - before < 0.9 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert e2e.tree_cpu_s(os.getpid()) - before >= 0.9
        assert e2e.tree_cpu_s(child.pid) == pytest.approx(e2e.children_cpu_s())  # it has no descendants
    finally:
        child.kill()
        child.wait()


def test_the_long_size_asks_both_sides_for_128_to_256_tokens(e2e, tmp_path):
    from services.config import load_run_config

    cfg = load_run_config(e2e.tandem_config("25m-long", tmp_path / "m", 6, 0, tmp_path))
    assert (cfg.sampling.min_tokens, cfg.sampling.max_tokens, cfg.sampling.group_size) == (128, 256, 8)
    assert cfg.model.max_model_len > 256 + 6 and cfg.learner.groups_per_step == e2e.SHAPES["25m-long"]["prompts"]
    assert not cfg.loss.filter_zero_variance and not cfg.eval.before and not cfg.eval.after


def test_length_statistics(e2e):
    assert e2e.length_stats([]) is None
    s = e2e.length_stats([128, 200, 256, 160])
    assert (s["n"], s["mean"], s["min"], s["max"]) == (4, 186.0, 128, 256)
    assert s["stdev"] == pytest.approx(55.1845, abs=1e-3)
    assert e2e.length_stats([130])["stdev"] == 0.0


def test_set_changes_tandems_config_and_a_wrong_key_fails_naming_it(e2e, tmp_path):
    from services.config import ConfigError, load_run_config

    path = e2e.tandem_config("example", tmp_path / "m", 150, 10, tmp_path,
                             ("staleness.max_staleness=2", 'publish.transport = "broadcast"'))
    cfg = load_run_config(path)
    assert (cfg.staleness.max_staleness, cfg.publish.transport) == (2, "broadcast")
    with pytest.raises(ConfigError, match="max_stalenes"):
        e2e.tandem_config("example", tmp_path / "m", 150, 10, tmp_path, ("staleness.max_stalenes=2",))


@pytest.mark.parametrize("item", ["staleness.max_staleness", "staleness.max_staleness=two words"])
def test_a_set_without_a_toml_value_names_itself(e2e, tmp_path, item):
    with pytest.raises(ValueError, match="expected SECTION.KEY=VALUE"):
        e2e.tandem_config("example", tmp_path / "m", 150, 10, tmp_path, (item,))
