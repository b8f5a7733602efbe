"""The pages themselves: the README stays a few screens (what tandem is, the two commands, an index of
docs/), and docs/configuration.md describes every section of the run config."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def test_readme_is_a_few_screens():
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move the detail to a page of docs/"


def test_readme_sets_up_with_exactly_two_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block, "README.md has no set-up commands"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make run", "make test"], commands


def test_readme_indexes_every_docs_page():
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README))
    assert pages and not set(pages) - linked, f"docs pages missing from the README's index: {sorted(set(pages) - linked)}"


def test_configuration_page_names_every_run_config_section():
    """docs/configuration.md's table of the run config lists every top-level field of RunConfig."""
    from services.config import RunConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `\[?(\w+)\]?` \|", page, re.M))
    missing = sorted(set(RunConfig.model_fields) - rows)
    assert not missing, f"docs/configuration.md does not describe run config sections {missing}"
