"""Every reference in the code and the docs resolves.

Scanned: the Markdown files (README.md, docs/*.md, any other tracked *.md), the comments and
docstrings of every *.py file, pyproject.toml and the Makefile. A reference is

- a path into the repository: one that starts with a top-level folder (``deploy/stack.py``,
  ``bench/e2e.py``, ``docs/settings.md``, ``tests/unit/<package>/``: placeholders and ``*`` match any
  name) or names a top-level file (``pyproject.toml``);
- a Markdown link ``[text](target#anchor)`` to a file of the repository, relative to the page,
  and its anchor, which must be a heading of the target;
- a section of docs/architecture.md: "docs/architecture.md section N", "sections N and M",
  "§N" anywhere, "section N" inside docs/architecture.md itself;
- a section of a page by its title: ``docs/performance.md, "Packed micro-batches"`` (a page name, a
  comma, a quoted title) must name a heading of that page, or a bold paragraph title
  (``**The cold start ends on a plateau.**``), by its whole text or its start, numbering left out;
- a Markdown file by its bare name (``tutorial.md``, ``README.md``): some file of the repository has
  that name. Private briefs the developers keep outside the repository (:data:`FORBIDDEN`) are never cited.

Not references: URLs (``https://gvisor.dev/docs/...``), absolute paths (``/runs`` inside a
container, ``/tmp/...``), paths under folders that are not the repository's (``runs/<id>/``,
``~/.cache/...``), paths git ignores (``deploy/wheelhouse/``: build outputs), and the files a run
writes that share a name with a source folder (:data:`RUN_FILES`).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ARCHITECTURE = "docs/architecture.md"
TOP_FOLDERS = ("host", "broker", "services", "control_plane", "rollout_server", "reward_server", "learner", "examples",
               "deploy", "bench", "tests", "docs", ".ci")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "docker-compose.yml", "docker-compose.cpu.yml")
RUN_FILES = {"learner/published.jsonl"}
"""Files inside a run directory (``runs/<id>/<id>/learner/published.jsonl``), not of the repository."""

URL = re.compile(r"[a-zA-Z][\w+.-]*://[^\s)>\]`'\"]+")
PATH = re.compile(r"(?<![\w./~$@-])((?:" + "|".join(map(re.escape, TOP_FOLDERS)) + r")/[\w./*<>{}-]*|"
                  + "|".join(map(re.escape, TOP_FILES)) + r")(?![\w-])")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
SECTION_OF_DOC = re.compile(re.escape(ARCHITECTURE) + r"[\s#*`\"'(]*(?:,\s*)?sections?\s+(\d+(?:\s*(?:,|and|or)\s*\d+)*)")
SECTION_SIGN = re.compile(r"§\s*(\d+)")
SECTION_BARE = re.compile(r"\bsections?\s+(\d+(?:\s*(?:,|and|or)\s*\d+)*)")
TITLED = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*[\w.-]+\.md)[`*]*,\s*(?:#\s*)?[\"\u201c]([^\"\u201d\n]+)[\"\u201d]")
"""A page and a quoted section title: ``docs/performance.md, "Packed micro-batches"`` (across a comment's lines too)."""
BARE_MD = re.compile(r"(?<![\w./<>*{}$-])([\w-][\w.-]*\.md)(?![\w-])")
FORBIDDEN = ("ARCHITECTURE" + ".md", "shared/" + "ARCHITECTURE", "MODAL" + "-NOTES")
"""The developers' briefs outside the repository: the project cites docs/ and public sources, never them."""


def scanned_files(root: Path) -> list[Path]:
    """The files to scan, relative to ``root``: what git tracks or would track, else every file."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        names = [Path(n) for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
    return sorted({n for n in names if (root / n).is_file() and (
        n.suffix in (".py", ".md") or n.as_posix() in ("pyproject.toml", "Makefile"))})


def python_text(source: str) -> list[tuple[int, str]]:
    """The comments and docstrings (every string that stands as a statement) of a Python file, with line numbers."""
    pieces: list[tuple[int, str]] = []
    last = -1  # consecutive comment lines form one piece, so a reference may wrap
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                if pieces and tok.start[0] == last + 1:
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + "\n" + tok.string)
                else:
                    pieces.append((tok.start[0], tok.string))
                last = tok.start[0]
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [(1, source)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            pieces.append((node.lineno, node.value.value))
    return pieces


def makefile_text(source: str) -> list[tuple[int, str]]:
    """A Makefile's comments and recipe lines. Variable values are left out: make assembles paths
    from them (``SLOW_FILES`` holds test names that ``--ignore=tests/integration/$(f).py`` completes)."""
    pieces: list[tuple[int, str]] = []
    logical: list[tuple[int, str]] = []  # backslash-continued lines joined, with their first line's number
    for number, line in enumerate(source.splitlines(), 1):
        if logical and logical[-1][1].endswith("\\"):
            logical[-1] = (logical[-1][0], logical[-1][1][:-1] + "\n" + line)
        else:
            logical.append((number, line))
    for number, line in logical:
        if line.startswith(("#", "\t")) and not re.match(r"[\w.-]+\s*[:?+]?=", line):
            pieces.append((number, line))
    return pieces


def text_of(root: Path, name: Path) -> list[tuple[int, str]]:
    source = (root / name).read_text(errors="replace")
    if name.suffix == ".py":
        return python_text(source)
    return makefile_text(source) if name.name == "Makefile" else [(1, source)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(markdown: str) -> list[str]:
    """The headings of a Markdown page, outside fenced code."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            found.append(m.group(1))
    return found


def titles(markdown: str) -> list[str]:
    """What a quoted citation may name on a page: its headings without their numbering ("1. The dataset" ->
    "the dataset") and the bold titles that open its paragraphs, lower case, closing punctuation dropped."""
    found = [re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", h) for h in headings(markdown)]
    found += re.findall(r"^(?:[-*]\s+)?\*\*([^*\n]+)\*\*", markdown, re.M)
    return [title_key(t) for t in found]


def title_key(title: str) -> str:
    return re.sub(r"[`*]", "", title).strip().rstrip(".:").lower()


def page_of(root: Path, name: Path, cited: str) -> Path | None:
    """The page a citation names: relative to the citing file's folder, else to the root, else in docs/."""
    for page in ((root / name).parent / cited, root / cited, root / "docs" / cited):
        if page.is_file():
            return page
    return None


def architecture_sections(root: Path) -> list[int]:
    page = root / ARCHITECTURE
    if not page.exists():
        return []
    return [int(m.group(1)) for h in headings(page.read_text()) if (m := re.match(r"(\d+)\. ", h))]


def ignored(root: Path, paths: set[str]) -> set[str]:
    """Those of ``paths`` that git ignores (build outputs such as deploy/wheelhouse/)."""
    if not paths:
        return set()
    try:
        out = subprocess.run(["git", "check-ignore", "--stdin", "--no-index"], cwd=root, input="\n".join(paths),
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return set()
    return set(out.stdout.split())


def exists(root: Path, path: str) -> bool:
    if any(c in path for c in "*<>{}"):
        pattern = re.sub(r"<[^>]*>?|\{[^}]*\}?", "*", path).rstrip("/")
        return next(iter(root.glob(pattern)), None) is not None
    return (root / path).exists()


def numbers(group: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", group)]


def broken_references(root: Path, files: list[Path] | None = None) -> list[str]:
    """Every reference in ``files`` (default: :func:`scanned_files`) that does not resolve, as ``file:line: what``."""
    files = scanned_files(root) if files is None else files
    sections = set(architecture_sections(root))
    markdown_names = {n.name for n in scanned_files(root) if n.suffix == ".md"}
    problems: list[tuple[str, str]] = []  # (where, what)
    missing: dict[str, list[str]] = {}
    for name in files:
        is_markdown = name.suffix == ".md"
        for first_line, raw in text_of(root, name):
            text = URL.sub(lambda m: " " * len(m.group()), raw)

            def where(pos: int) -> str:
                return f"{name}:{first_line + text.count(chr(10), 0, pos)}"  # noqa: B023

            for bad in FORBIDDEN:
                for m in re.finditer(re.escape(bad), text):
                    problems.append((where(m.start()), f"cites {bad}, which is not in the repository: "
                                                       "cite docs/ or the public source"))
            for m in PATH.finditer(text):
                path = m.group(1).rstrip(".-")
                if path not in RUN_FILES and not exists(root, path):
                    missing.setdefault(path, []).append(where(m.start()))
            refs = [(m, numbers(m.group(1))) for m in SECTION_OF_DOC.finditer(text)]
            refs += [(m, numbers(m.group(1))) for m in SECTION_SIGN.finditer(text)]
            if name.as_posix() == ARCHITECTURE:
                refs += [(m, numbers(m.group(1))) for m in SECTION_BARE.finditer(text)]
            for m, cited in refs:
                for n in cited:
                    if n not in sections:
                        problems.append((where(m.start()), f"{ARCHITECTURE} has no section {n} "
                                                           f"(it has {sorted(sections)})"))
            for m in TITLED.finditer(text):
                cited, title = m.group(1), m.group(2)
                page = page_of(root, name, cited)
                if page is not None and not any(t.startswith(title_key(title)) for t in titles(page.read_text())):
                    problems.append((where(m.start()), f'{cited}, "{title}": no such heading in {cited}'))
            for m in BARE_MD.finditer(text):
                if m.group(1) not in markdown_names and not any(bad in m.group(1) for bad in FORBIDDEN):
                    problems.append((where(m.start()), f"{m.group(1)}: no file of that name in the repository"))
            if not is_markdown:
                continue
            for m in LINK.finditer(text):
                target, _, anchor = m.group(1).partition("#")
                page = (root / name).parent / target if target else root / name
                if target and not page.exists():
                    problems.append((where(m.start()), f"link to {m.group(1)}: no such file"))
                elif anchor and page.suffix == ".md" and anchor not in {slug(h) for h in headings(page.read_text())}:
                    problems.append((where(m.start()), f"link to {m.group(1)}: no heading #{anchor} there"))
    skipped = ignored(root, set(missing))
    for path, places in missing.items():
        if path not in skipped and path.rstrip("/") not in skipped:
            problems += [(place, f"{path}: no such file or folder in the repository") for place in places]
    return sorted(f"{where}: {what}" for where, what in problems)


def test_every_reference_resolves():
    problems = broken_references(ROOT)
    assert not problems, f"{len(problems)} broken references:\n" + "\n".join(problems[:60])


def test_architecture_sections_are_numbered_in_order():
    sections = architecture_sections(ROOT)
    assert sections == list(range(1, len(sections) + 1)) and len(sections) >= 7, sections


def test_the_checker_finds_what_is_broken_and_only_that(tmp_path):
    """A small tree with one of each broken reference, and the look-alikes that are not references."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "admission.py").write_text(
        '"""The staleness bound (docs/architecture.md section 1); see broker/gone.py."""\n'
        "# docs/architecture.md\n# section 9: a cited section that does not exist\n"
        '# docs/architecture.md,\n# "Data flow" (a title across two comment lines), and\n'
        '# (docs/architecture.md, "No such flow") and the ' + "MODAL" + "-NOTES brief\n"
        "x = 'docs/not-a-comment.md'  # a plain string is code, not a reference\n")
    (tmp_path / ARCHITECTURE).write_text("# Architecture\n\n## 1. Data flow\n\n```\n# 2. not a heading\n```\n"
                                         "As section 1 says; section 2 does not exist.\n")
    (tmp_path / "README.md").write_text(
        "See [the flow](docs/architecture.md#1-data-flow), [nothing](docs/nothing.md), "
        "[a lost anchor](docs/architecture.md#2-layers) and §3.\n"
        "Not references: https://gvisor.dev/docs/user_guide/install/, runs/<run_id>/summary.json, "
        "/runs/models/arith, $PWD/examples/arith/, ~/.cache/tandem, broker/<module>.py, "
        "learner/published.jsonl.\n"
        "Cited wrongly: the " + "ARCHITECTURE" + ".md brief.\n"
        'Titles: docs/architecture.md, "Data flow" and (architecture.md, "data"), a bold one (README.md, '
        '"The point"); none: docs/architecture.md, "Layers". Names: architecture.md, README.md, NOTES.md, *.md.\n'
        "**The point.** A bold paragraph title.\n")
    files = [Path("README.md"), Path(ARCHITECTURE), Path("broker/admission.py")]
    found = broken_references(tmp_path, files)
    expected = [
        "README.md:1: docs/architecture.md has no section 3 (it has [1])",
        "README.md:1: docs/nothing.md: no such file or folder in the repository",
        "README.md:1: link to docs/architecture.md#2-layers: no heading #2-layers there",
        "README.md:1: link to docs/nothing.md: no such file",
        "README.md:3: cites " + "ARCHITECTURE" + ".md, which is not in the repository: cite docs/ or the public source",
        'README.md:4: docs/architecture.md, "Layers": no such heading in docs/architecture.md',
        "README.md:4: NOTES.md: no file of that name in the repository",
        'broker/admission.py:6: docs/architecture.md, "No such flow": no such heading in docs/architecture.md',
        "broker/admission.py:6: cites " + "MODAL" + "-NOTES, which is not in the repository: cite docs/ or the public source",
        "broker/admission.py:1: broker/gone.py: no such file or folder in the repository",
        "broker/admission.py:2: docs/architecture.md has no section 9 (it has [1])",
        "docs/architecture.md:8: docs/architecture.md has no section 2 (it has [1])",
    ]
    assert found == sorted(expected), "\n".join(found)
