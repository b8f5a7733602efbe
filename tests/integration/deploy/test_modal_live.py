"""A live smoke test of the deployed Modal app: runs only with Modal credentials (``MODAL_TOKEN_ID``).

No credentials exist on the project's machines, so CI skips it (and says so); the offline graph and
settings checks are tests/unit/deploy/test_modal_app.py. With credentials, from the repository root::

    MODAL_TOKEN_ID=... MODAL_TOKEN_SECRET=... .venv/bin/python -m pytest -m modal tests/integration/deploy/test_modal_live.py

It deploys the example app under a throw-away name with no GPU container kept warm (rollout
``min_containers = 0``; the learner is never spawned), so it costs CPU minutes only. It needs the
Secret ``tandem`` (TANDEM_TOKEN, REDIS_URL) to exist in the workspace, as the steps in docs/modal.md
create it; the token is read from ``TANDEM_TOKEN`` here. Then it checks that the control plane
answers over Modal's web endpoint with tandem's auth in force, that the reward server scores a
``python_tests`` item by running it in a Modal Sandbox, and stops the app.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

pytestmark = [
    pytest.mark.modal,
    pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="no Modal credentials (MODAL_TOKEN_ID unset)"),
]

ROOT = Path(__file__).resolve().parents[3]
NO_GPU_KEPT = """
[modal]
app_name = "{name}"
[modal.rollout]
gpu = "L4"
min_containers = 0
max_containers = 1
[modal.learner]
gpu = "L4"
"""


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    import modal

    name = f"tandem-smoke-{uuid.uuid4().hex[:8]}"
    section = tmp_path_factory.mktemp("modal") / "deploy.toml"
    section.write_text(NO_GPU_KEPT.format(name=name))
    env = dict(os.environ, DEPLOY_RUN_CONFIG=str(ROOT / "examples" / "arith" / "run.toml"),
               DEPLOY_MODAL_TOML=str(section))
    subprocess.run([sys.executable, "-m", "modal", "deploy", "-m", "deploy.modal_app"], cwd=ROOT, env=env,
                   check=True, timeout=1800)
    try:
        yield {role: modal.Function.from_name(name, role).get_web_url() for role in ("control", "reward")}
    finally:
        subprocess.run([sys.executable, "-m", "modal", "app", "stop", name], cwd=ROOT, timeout=300)


def test_control_plane_answers_with_auth(deployed):
    token = os.environ["TANDEM_TOKEN"]
    with httpx.Client(base_url=deployed["control"], timeout=300) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/runs").status_code == 401
        assert c.get("/v1/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_reward_server_runs_code_in_a_modal_sandbox(deployed):
    token = os.environ["TANDEM_TOKEN"]
    spec = {"type": "python_tests", "tests": ["assert add(2, 3) == 5"]}
    items = [{"id": "good", "completion": "```python\ndef add(a, b):\n    return a + b\n```", "spec": spec},
             {"id": "bad", "completion": "```python\ndef add(a, b):\n    return a - b\n```", "spec": spec}]
    with httpx.Client(base_url=deployed["reward"], timeout=600,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        r = c.post("/v1/score", json={"items": items})
    assert r.status_code == 200, r.text
    rewards = {s["id"]: s["reward"] for s in r.json()["results"]}
    assert rewards == {"good": 1.0, "bad": 0.0}
