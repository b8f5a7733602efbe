"""The layer contract (pyproject.toml, checked by `lint-imports` in `make test`) covers every module.

import-linter checks only the modules a layer names: a new module in
``services/`` that no layer lists would escape the contract. This test keeps
the list complete, and runs the linter itself so that a plain pytest run
checks the layers too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layered_modules() -> set[str]:
    layers = next(c for c in CONTRACTS if c["type"] == "layers")["layers"]
    return {m.strip() for layer in layers for m in re.split(r"[|:]", layer)}


def test_every_module_of_the_service_kit_is_in_a_layer():
    named = layered_modules()
    services = {f"services.{p.stem}" for p in (ROOT / "services").glob("*.py") if p.stem != "__init__"}
    services |= {f"services.{p.parent.name}" for p in (ROOT / "services").glob("*/__init__.py")}
    assert services - named == set(), "add these modules to a layer in pyproject.toml [tool.importlinter]"
    assert {"broker", "rollout_server", "reward_server", "learner", "examples"} <= named


def test_lint_imports_keeps_every_contract():
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"{len(CONTRACTS)} kept, 0 broken" in out.stdout
