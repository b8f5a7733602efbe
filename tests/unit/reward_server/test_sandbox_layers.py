"""The sandbox package's layers: backends build on the shared modules, never on each other."""

from __future__ import annotations

import ast
from pathlib import Path

import reward_server.sandbox as sandbox_package

PACKAGE = Path(sandbox_package.__file__).parent
BACKENDS = {"gvisor", "bwrap", "modal", "local"}
SHARED = {"base", "runtime", "pool", "guest", "cgroup", "seccomp", "blame"}


def imported_sandbox_modules(path: Path) -> set[str]:
    """The ``reward_server.sandbox.X`` modules (first part X) that ``path`` imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.level == 0 else [f"reward_server.sandbox.{node.module}"]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.startswith("reward_server.sandbox."):
                found.add(name.split(".")[2])
    return found


def test_every_module_of_the_package_is_a_backend_or_shared():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {"guest"}
    assert modules == BACKENDS | SHARED, "a new sandbox module: name it a backend or a shared layer here"


def test_no_backend_imports_another_backend():
    for backend in sorted(BACKENDS):
        others = imported_sandbox_modules(PACKAGE / f"{backend}.py") & (BACKENDS - {backend})
        assert not others, f"sandbox/{backend}.py imports the backend(s) {sorted(others)}; move what they share to base/runtime"


def test_shared_modules_import_no_backend():
    for shared in sorted(SHARED - {"guest"}):
        backends = imported_sandbox_modules(PACKAGE / f"{shared}.py") & BACKENDS
        assert not backends, f"sandbox/{shared}.py imports the backend(s) {sorted(backends)}"
