"""docs/modal.md's walk-through is the live Modal test's list of commands, so the two cannot drift: the
test (tests/integration/deploy/test_modal_live.py) runs exactly what the page tells a user to type."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MARKER = "<!-- walkthrough:"


def page_commands() -> list[str]:
    """The commands of the first bash block after the walk-through marker (comment lines left out)."""
    page = (ROOT / "docs" / "modal.md").read_text()
    assert MARKER in page, "docs/modal.md lost its walk-through marker"
    block = re.search(r"```bash\n(.*?)```", page[page.index(MARKER):], re.S)
    assert block, "no bash block after the walk-through marker"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_page_shows_the_live_tests_commands_in_order():
    from tests.integration.deploy.test_modal_live import WALKTHROUGH

    assert page_commands() == WALKTHROUGH


def test_the_walkthrough_uses_the_deployed_apps_names():
    """The app, secrets and volume the commands name are those the deploy section gives the example."""
    from deploy.config import ModalDeploy, app_name, load_deploy, role_secret
    from services.config import load_run_config
    from tests.integration.deploy.test_modal_live import APP, WALKTHROUGH

    plan = load_deploy(ROOT / "examples" / "arith" / "modal.toml")
    assert app_name(plan, load_run_config(ROOT / "examples" / "arith" / "run.toml").name) == APP
    text = "\n".join(WALKTHROUGH)
    for role in ("control", "reward"):
        name, keys = role_secret(plan, role)
        create = next(x for x in WALKTHROUGH if x.startswith(f".venv/bin/modal secret create --force {name} "))
        assert sorted(re.findall(r"(\w+)=", create)) == sorted(keys), (name, create)
    assert f"modal volume put --force {plan.volume} " in text and f"modal app stop {APP}" in text
    assert plan.volume == ModalDeploy().volume
