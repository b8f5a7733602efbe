"""The layer contract (pyproject.toml, checked by `lint-imports` in `make test`) covers every module.

Each layer names whole top-level packages, so a new module is covered by the
package it lives in; a new top-level package that no layer lists would escape
the contract. This test keeps the list complete, and runs the linter itself so
that a plain pytest run checks the layers too.
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


def test_every_top_level_package_is_a_layer_of_its_own():
    named = layered_modules()
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in {"tests", "bench"}}
    assert packages == named, "every top-level package is one whole layer in pyproject.toml [tool.importlinter]"
    assert all("." not in m for m in named), f"a layer names a module, not a package: {sorted(named)}"


def test_lint_imports_keeps_every_contract():
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"{len(CONTRACTS)} kept, 0 broken" in out.stdout
