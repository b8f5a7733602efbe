"""What a token holder who is not the operator can make a real control plane do (docs/security.md,
"Tokens and scopes"): a `tandem serve control` process of its own, reached over HTTP.

- a run config cannot choose where the tracker hub writes (``logging.dir`` outside the run directory)
  nor what MLflow connects to (a ``mlflow_tracking_uri`` the operator did not list);
- a run's ``model.path`` outside the run directory is refused, the same whether it exists or not;
- a token stops and deletes only the runs and prompt sets it made (another's need ``admin``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.control import ARITH_LINES, TOKEN, run_config

pytestmark = pytest.mark.slow  # a control plane process each


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _upload(client: httpx.AsyncClient, token: str = TOKEN, lines: list[dict] = ARITH_LINES) -> httpx.Response:
    body = "\n".join(json.dumps(x) for x in lines).encode() + b"\n"
    return await client.post("/v1/prompt-sets", content=body,
                             headers={**_auth(token), "Content-Type": "application/x-ndjson"})


async def test_a_run_config_cannot_choose_where_trackers_write_nor_what_mlflow_connects_to(control_process, tmp_path):
    run_dir, outside = tmp_path / "runs", tmp_path / "outside"
    model = run_dir / "models" / "m"
    model.mkdir(parents=True)
    allowed = tmp_path / "operators-mlflow"
    allowed.mkdir()
    allowed_uri = f"sqlite:///{allowed / 'mlflow.db'}"
    url = control_process(TANDEM_RUN_DIR=str(run_dir), TANDEM_CONTROL_MLFLOW_TRACKING_URIS=json.dumps([allowed_uri]))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        set_id = (await _upload(client)).json()["id"]

        async def create(logging: dict) -> httpx.Response:
            config = run_config(model={"path": str(model)}, logging=logging)
            return await client.post("/v1/runs", headers=_auth(TOKEN), json={"prompt_set_id": set_id, "config": config})

        crafted = [
            ({"trackers": ["tensorboard"], "dir": str(outside)}, "logging.dir"),
            ({"trackers": ["tensorboard"], "dir": "../outside"}, "logging.dir"),
            ({"trackers": ["tensorboard"], "dir": "models/../../outside"}, "logging.dir"),
            ({"trackers": ["mlflow"], "mlflow_tracking_uri": f"sqlite:///{outside / 'mlflow.db'}"},
             "logging.mlflow_tracking_uri"),
            ({"trackers": ["mlflow"], "mlflow_tracking_uri": "http://127.0.0.1:9/"}, "logging.mlflow_tracking_uri"),
        ]
        for logging, field in crafted:
            r = await create(logging)
            assert r.status_code == 422 and r.json()["detail"].startswith(field), (logging, r.text)
        assert not outside.exists()
        assert (await client.get("/v1/runs", headers=_auth(TOKEN))).json() == []

        # under the run directory, and the URI the operator listed: the run is created and logs there
        r = await create({"trackers": ["tensorboard", "mlflow"], "dir": "shared-trackers",
                          "mlflow_tracking_uri": allowed_uri})
        assert r.status_code == 201, r.text
        assert (run_dir / "shared-trackers" / "tensorboard").is_dir() and (allowed / "mlflow.db").is_file()


async def test_a_model_path_outside_the_run_directory_is_refused_without_being_looked_at(control_process, tmp_path):
    run_dir, outside = tmp_path / "runs", tmp_path / "outside"
    (run_dir / "models" / "m").mkdir(parents=True)
    outside.mkdir()
    (run_dir / "models" / "link").symlink_to(outside)
    url = control_process(TANDEM_RUN_DIR=str(run_dir), TANDEM_CONTROL_MODEL_DIRS="[]")  # the default: none
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        set_id = (await _upload(client)).json()["id"]

        async def create(path, client_run_dir: str | None = None) -> httpx.Response:
            body = {"prompt_set_id": set_id, "config": run_config(model={"path": str(path)})}
            return await client.post("/v1/runs", headers=_auth(TOKEN), json=body | {"client_run_dir": client_run_dir})

        # a folder that exists and one that does not get the same answer: it tells nothing of the disk
        answers = []
        for path in (outside, tmp_path / "nothing-here", run_dir / "models" / "link", run_dir / ".." / "outside"):
            r = await create(path)
            assert r.status_code == 422 and r.json()["detail"].startswith("model.path:"), r.text
            answers.append(r.json()["detail"].replace(str(path), "<path>"))
        assert len(set(answers)) == 1 and "outside the control plane's run directory" in answers[0], answers
        # mapped from the client's run directory onto a symlink that leaves this one: refused too
        r = await create(tmp_path / "laptop" / "models" / "link", client_run_dir=str(tmp_path / "laptop"))
        assert r.status_code == 422 and r.json()["detail"].startswith("model.path:"), r.text
        assert (await client.get("/v1/runs", headers=_auth(TOKEN))).json() == []
        # inside: accepted
        r = await create(run_dir / "models" / "m")
        assert r.status_code == 201, r.text


ALICE = "submitter-alice-token-0123"
BOB = "submitter-bob-token-456789"
READER = "a-read-only-token-0123456"


@pytest.mark.parametrize("scope", ["submit", "write"])  # "write": the old name, kept for existing TANDEM_TOKENS
async def test_a_token_stops_and_deletes_only_what_it_made(control_process, tmp_path, scope):
    run_dir = tmp_path / "runs"
    model = run_dir / "models" / "m"
    model.mkdir(parents=True)
    tokens = {ALICE: ["read", scope], BOB: ["read", scope], READER: ["read"]}
    url = control_process(TANDEM_RUN_DIR=str(run_dir), TANDEM_TOKENS=json.dumps(tokens))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await _upload(client, ALICE)
        assert r.status_code == 201, r.text
        alices_set = r.json()["id"]
        r = await client.post("/v1/runs", headers=_auth(ALICE),
                              json={"prompt_set_id": alices_set, "config": run_config(model={"path": str(model)})})
        assert r.status_code == 201, r.text
        alices_run = r.json()["run_id"]

        # Bob, another owner, may read them but neither stop nor delete them
        r = await client.post(f"/v1/runs/{alices_run}/stop", headers=_auth(BOB))
        assert r.status_code == 403 and "'admin' scope" in r.json()["detail"], r.text
        r = await client.delete(f"/v1/prompt-sets/{alices_set}", headers=_auth(BOB))
        assert r.status_code == 403 and "'admin' scope" in r.json()["detail"], r.text
        assert (await client.get(f"/v1/runs/{alices_run}", headers=_auth(BOB))).json()["run"]["state"] == "queued"
        assert (await client.get(f"/v1/prompt-sets/{alices_set}", headers=_auth(BOB))).status_code == 200
        # a read-only token submits nothing
        r = await _upload(client, READER, ARITH_LINES[:2])
        assert r.status_code == 403 and "'submit' scope" in r.json()["detail"], r.text

        # Alice stops her own run; Bob deletes his own set; the operator's token deletes Alice's
        r = await client.post(f"/v1/runs/{alices_run}/stop", headers=_auth(ALICE))
        assert r.status_code == 200 and r.json()["state"] == "stopped", r.text
        r = await _upload(client, BOB, ARITH_LINES[:2])
        assert r.status_code == 201, r.text
        assert (await client.delete(f"/v1/prompt-sets/{r.json()['id']}", headers=_auth(BOB))).status_code == 200
        assert (await client.delete(f"/v1/prompt-sets/{alices_set}", headers=_auth(TOKEN))).status_code == 200
