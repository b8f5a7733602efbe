"""docs/modal.md's walk-through, run against Modal's cloud: only with Modal credentials (``MODAL_TOKEN_ID``).

No credentials exist on the project's machines, so CI skips it (and says so); nothing here has been
run against Modal. The offline checks of the same app are tests/unit/deploy/test_modal_app.py,
tests/integration/deploy/test_modal_learner.py and tests/integration/deploy/test_submit_paths.py. With
credentials and an external Redis, from the repository root::

    MODAL_TOKEN_ID=... MODAL_TOKEN_SECRET=... REDIS_URL=rediss://... \\
        .venv/bin/python -m pytest -m modal tests/integration/deploy/test_modal_live.py

It runs :data:`WALKTHROUGH`, the very commands docs/modal.md shows (tests/unit/docs/test_modal_walkthrough.py
checks that the page's block is this list), on the arith example with one L4 per role
(``examples/arith/modal.toml``): secrets, volume, the example policy built and uploaded, ``tandem deploy
modal``, ``tandem submit``. Between the submit and the stop it checks what the walk-through promises:
the run trains 10 steps, a published version reaches a rollout server through the Volume (the rollout
server reports serving it, which it does only after reloading the Volume and verifying the version's
checksum), and the dashboard renders (its page and every file it loads). Then it stops the run and
the app, also when a check failed. It costs GPU minutes: an L4 rollout server and an L4 learner for
the few minutes the steps take, after the images are built (the first deploy builds them).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [
    pytest.mark.modal,
    pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="no Modal credentials (MODAL_TOKEN_ID unset)"),
]

ROOT = Path(__file__).resolve().parents[3]
APP = "tandem-arith"

WALKTHROUGH = [
    "export TANDEM_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')",
    "export REWARD_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')",
    "export TANDEM_OPENAI_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')",
    "export REDIS_URL='rediss://default:<password>@<host>:6379'",
    '.venv/bin/modal secret create --force tandem TANDEM_TOKEN="$TANDEM_TOKEN" REDIS_URL="$REDIS_URL" '
    'TANDEM_ROLLOUT_REWARD_TOKEN="$REWARD_TOKEN" TANDEM_CONTROL_REWARD_TOKEN="$REWARD_TOKEN" '
    'TANDEM_OPENAI_TOKEN="$TANDEM_OPENAI_TOKEN"',
    '.venv/bin/modal secret create --force tandem-reward TANDEM_TOKEN="$REWARD_TOKEN"',
    ".venv/bin/modal volume create tandem-runs || true",
    ".venv/bin/tandem bootstrap-model --out /tmp/tandem-arith-model",
    ".venv/bin/modal volume put --force tandem-runs /tmp/tandem-arith-model models/arith",
    ".venv/bin/tandem deploy modal --config examples/arith/run.toml --modal-toml examples/arith/modal.toml",
    "export TANDEM_URL=$(.venv/bin/python -c \"import modal; "
    "print(modal.Function.from_name('tandem-arith', 'control').get_web_url())\")",
    "RUN=$(.venv/bin/tandem submit examples/arith/train.jsonl --config examples/arith/run.toml)",
    '.venv/bin/tandem status "$RUN"',
    '.venv/bin/tandem stop "$RUN"',
    ".venv/bin/modal app stop tandem-arith",
]
"""docs/modal.md's walk-through, command by command (the page shows them in one block, with comments)."""

PLACEHOLDER = "export REDIS_URL='rediss://default:<password>@<host>:6379'"
"""The one line the test does not run: it uses the ``REDIS_URL`` it is given."""
SUBMITTED = WALKTHROUGH.index('.venv/bin/tandem status "$RUN"')
"""The lines up to here deploy and submit; the checks run before the rest."""


def _bash(lines: list[str], env: dict, timeout_s: float, show: tuple[str, ...] = ()) -> dict[str, str]:
    """Run ``lines`` in one bash (stop at the first failure); return the variables named in ``show``."""
    script = "\n".join(["set -euo pipefail", *[x for x in lines if x != PLACEHOLDER],
                        *[f'echo "{name}=${name}"' for name in show]])
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"walk-through failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return dict(re.findall(r"^(\w+)=(.*)$", done.stdout, re.M))


def test_the_walkthrough_trains_publishes_through_the_volume_and_renders_the_dashboard():
    assert os.environ.get("REDIS_URL"), "set REDIS_URL to an external Redis the Modal containers reach"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}  # a user's shell (conftest sets
    # TANDEM_RUN_DIR for the services tests start; the walk-through's client keeps the default, runs/)
    try:
        found = _bash(WALKTHROUGH[:SUBMITTED], env, timeout_s=3600, show=("RUN", "TANDEM_URL", "TANDEM_TOKEN"))
        run_id, url, token = found["RUN"], found["TANDEM_URL"], found["TANDEM_TOKEN"]
        env |= {"RUN": run_id, "TANDEM_URL": url, "TANDEM_TOKEN": token}
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {token}"}) as c:
            deadline = time.monotonic() + 3600
            while True:
                status = c.get(f"/v1/runs/{run_id}").json()
                assert status["run"]["state"] in ("queued", "running"), status
                if status["run"]["step"] >= 10:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(10)
            assert status["weights_version"] >= 10
            served = asyncio.run(_served_versions(run_id))
            assert served and max(served.values()) >= 1, served  # a version reached a rollout server
            _dashboard_renders(url, token)
        _bash(WALKTHROUGH[SUBMITTED:], env, timeout_s=600)
    finally:
        subprocess.run([str(ROOT / ".venv/bin/modal"), "app", "stop", APP], cwd=ROOT, env=env, timeout=300)


async def _served_versions(run_id: str) -> dict[str, int]:
    """server id -> the weight version each rollout server reports serving (loaded from the Volume)."""
    from broker import Keys, WeightRegistry, connect

    redis = connect(os.environ["REDIS_URL"])
    try:
        return {server: version for server, version in (await WeightRegistry(redis, Keys(run_id)).in_use()).items()}
    finally:
        await redis.aclose()


def _dashboard_renders(url: str, token: str) -> None:
    """The page (signed in with ``?token=``), each static file it loads, and the chart layout it asks for."""
    with httpx.Client(base_url=url, timeout=120, follow_redirects=True) as browser:  # ?token= redirects, with a cookie
        page = browser.get("/", params={"token": token})
        assert page.status_code == 200 and "text/html" in page.headers["content-type"], page.text[:500]
        files = re.findall(r'(?:src|href)="/?static/([^"?]+)', page.text)
        assert "dashboard.js" in files, page.text[:2000]
        for name in files:
            assert browser.get(f"/static/{name}").status_code == 200, name
        assert browser.get("/v1/dashboard/charts").status_code == 200
