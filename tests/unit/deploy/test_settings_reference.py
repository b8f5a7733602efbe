"""docs/settings.md is what `tandem config --markdown` prints, and it lists every variable.

The reference is generated from the settings classes, so it cannot drift from them the way a table
kept by hand did (the README's omitted TANDEM_RUN_DIR_VOLUME). These tests fail when a setting is
added, removed or re-documented without regenerating the page.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

from deploy.settings_reference import SETTINGS_REFERENCE, settings_classes
from services.settings import env_names

ROOT = Path(__file__).resolve().parents[3]
REGENERATE = f".venv/bin/tandem config --markdown > {SETTINGS_REFERENCE}"


def generated() -> str:
    """The real command's output, in an environment with no TANDEM_* variable (the page must not depend on it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "config", "--markdown"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_committed_reference_is_the_generated_one():
    committed = (ROOT / SETTINGS_REFERENCE).read_text()
    fresh = generated()
    diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                        f"{SETTINGS_REFERENCE} (committed)", "tandem config --markdown", n=0))
    assert committed == fresh, f"{SETTINGS_REFERENCE} is out of date; regenerate it: {REGENERATE}\n{diff[:3000]}"


def test_the_environment_does_not_change_the_page():
    env = {"TANDEM_PORT": "9999", "TANDEM_ROLLOUT_SEED": "7", "REDIS_URL": "redis://:pw-5e7c1a@h:1"}
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "config", "--markdown"], cwd=ROOT,
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == generated()
    assert "9999" not in out.stdout and "pw-5e7c1a" not in out.stdout


def test_every_variable_is_listed_with_its_meaning():
    page = (ROOT / SETTINGS_REFERENCE).read_text()
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    for name, cls in settings_classes().items():
        for variable in env_names(cls):
            assert variable in rows, f"{variable} ({name}) is missing from {SETTINGS_REFERENCE}: {REGENERATE}"
        for field_name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{field_name} has no docstring: document it where it is declared"
    assert "TANDEM_RUN_DIR_VOLUME" in rows
