"""``tandem run`` on a copy of examples/arith broken as a user breaks it: one line on stderr, ``tandem run:
<file>: <what is wrong>; <what to change>``, exit 2, no traceback, and nothing started.

Each case runs the real CLI in a subprocess. ``--runs`` names a file, not a folder: a check that came
after the stack's start would fail there at once (``Stack.start`` makes its folder under it) instead of
starting vLLM and the learner, so a test here never starts a service."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "arith"


def _example(tmp_path: Path) -> Path:
    """examples/arith's config and prompt sets in ``tmp_path``, its model a stand-in folder (nothing loads it)."""
    for name in ("run.toml", "train.jsonl", "eval.jsonl"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    _edit(tmp_path / "run.toml", ('path = "../../runs/models/arith"', 'path = "model"'),
          ('bootstrap = "arith"', ""))
    return tmp_path / "run.toml"


def _edit(path: Path, *replacements: tuple[str, str]) -> None:
    text = path.read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)


def _rewrite_lines(path: Path, change) -> None:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps(change(line)) + "\n" for line in lines))


def _tandem_run(config: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    guard = tmp_path / "runs"
    guard.write_text("a file where the runs folder would go: a stack cannot start under it\n")
    return subprocess.run([sys.executable, "-m", "deploy.cli", "run", str(config), "--runs", str(guard)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "1000"})


def _one_line(done: subprocess.CompletedProcess, file: Path, *says: str) -> None:
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"tandem run: {file}: "), lines[0]
    for fragment in says:
        assert fragment in lines[0], lines[0]


def test_malformed_toml(tmp_path):
    config = _example(tmp_path)
    _edit(config, ("[loss]", "[loss"))
    line = config.read_text().splitlines().index("[loss") + 1
    _one_line(_tandem_run(config, tmp_path), config, "not valid TOML", f"at line {line},")


def test_unknown_config_key_names_the_field_it_is_close_to(tmp_path):
    config = _example(tmp_path)
    _edit(config, ("eps_high = 0.28", "eps_hihg = 0.28"))
    _one_line(_tandem_run(config, tmp_path), config, "loss.eps_hihg: unknown field; did you mean eps_high?")


@pytest.mark.parametrize("field", ["train", "eval"])
def test_a_prompt_set_that_does_not_exist(tmp_path, field):
    """Before: a FileNotFoundError traceback, after the stack had started (a minute) unless a bootstrap
    read the file first."""
    config = _example(tmp_path)
    _edit(config, (f'{field} = "{field}.jsonl"', f'{field} = "{field}-set.jsonl"'))
    _one_line(_tandem_run(config, tmp_path), config,
              f"data.{field}: {tmp_path / f'{field}-set.jsonl'} does not exist; correct the path")


def test_a_dataset_where_tandem_run_reads_json_lines(tmp_path):
    config = _example(tmp_path)
    (tmp_path / "train.parquet").write_bytes(b"PAR1\x15\x04PAR1")
    _edit(config, ('train = "train.jsonl"', 'train = "train.parquet"'))
    _one_line(_tandem_run(config, tmp_path), config, "data.train:", "is a dataset, not the JSON lines",
              "tandem prompts import")


def test_no_answers_to_bootstrap_from(tmp_path):
    """The issue's run: every line's reward a python function, the example's bootstrap left in the config.
    Before: ``ValueError: ...: no line has an 'answer' to learn from`` as a traceback, after the bootstrap
    had been announced."""
    config = _example(tmp_path)
    _edit(config, ('path = "model"', 'path = "new-model"\nbootstrap = "arith"'))
    train = tmp_path / "train.jsonl"
    _rewrite_lines(train, lambda line: {"prompt": line["prompt"], "type": "python", "function": "m:overlong"})
    _one_line(_tandem_run(config, tmp_path), train, "no line has a 'prompt' and an 'answer'",
              "remove model.bootstrap")
    assert not (tmp_path / "new-model").exists()


def test_a_column_the_template_names_is_missing(tmp_path):
    """Before: the stack started (a minute), then ``httpx.HTTPStatusError: ... 422`` as a traceback."""
    config = _example(tmp_path)
    _edit(config, ("[sampling]", '[prompt]\ntemplate = "{problem}"\n\n[sampling]'))
    for name in ("train.jsonl", "eval.jsonl"):
        _rewrite_lines(tmp_path / name, lambda line: {"question": line["prompt"], "answer": line["answer"]})
    _one_line(_tandem_run(config, tmp_path), tmp_path / "train.jsonl",
              "line 1: problem: prompt.template uses {problem}, and the line has no such field (it has: question)",
              f"the [reward] and [prompt] sections of {config}")


def test_held_out_lines_without_the_answer_column(tmp_path):
    config = _example(tmp_path)
    _rewrite_lines(tmp_path / "eval.jsonl", lambda line: {"prompt": line["prompt"]})
    _one_line(_tandem_run(config, tmp_path), tmp_path / "eval.jsonl", "line 1: answer: Field required")


def test_a_model_path_with_no_model(tmp_path):
    """Before: ``tandem run failed: model.path ...``, exit 1, not naming the config."""
    config = _example(tmp_path)
    _edit(config, ('path = "model"', 'path = "no-model"'))
    _one_line(_tandem_run(config, tmp_path), config, f"model.path: {tmp_path / 'no-model'} holds no model",
              "model.bootstrap")
