"""`tandem submit` to a deployment whose disk is not the submitting machine's (Modal, docker-compose).

The run config is read on the user's machine, where ``model.path`` (``../../runs/models/arith``) resolves
to that machine's folder; a deployed rollout server loads the model from the deployment's run
directory and serves a run only if the run names that folder (``rollout_server.follower.serves_model``),
and the learner loads the run's path. Here the "deployment" is a real control plane whose run directory
is ``<root>/runs`` and whose run config sits at ``<root>/examples/arith/run.toml``, the layout of a
Modal container (``/runs``, ``/examples/arith/run.toml``); the user's machine is another folder, with
no model in it. Before the control plane mapped the path, the run stored the user's folder and no
rollout server would serve it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from rollout_server.follower import serves_model
from services.config import load_run_config
from services.runs import RunStore
from tests.fixtures.control import TOKEN, control_settings
from tests.servers import uvicorn_server

ROOT = Path(__file__).resolve().parents[3]


def _repository(at: Path, model: str = "arith") -> Path:
    """The example's config and data under ``at`` (``at/examples/arith``), naming ``runs/models/<model>``."""
    folder = at / "examples" / "arith"
    folder.mkdir(parents=True)
    for name in ("train.jsonl", "eval.jsonl"):
        shutil.copy(ROOT / "examples" / "arith" / name, folder / name)
    text = (ROOT / "examples" / "arith" / "run.toml").read_text()
    (folder / "run.toml").write_text(text.replace("runs/models/arith", f"runs/models/{model}"))
    return folder / "run.toml"


async def _submit(config: Path, url: str, client_run_dir: Path) -> tuple[int, str]:
    env = {**os.environ, "TANDEM_URL": url, "TANDEM_TOKEN": TOKEN, "TANDEM_RUN_DIR": str(client_run_dir)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deploy.cli", "submit", str(config.parent / "train.jsonl"), "--config", str(config),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_submit_stores_the_model_path_the_deployed_services_load(control_db_url, control_redis, tmp_path):
    from control_plane import build_app
    from host.processes import free_port

    deployment, laptop = tmp_path / "deployment", tmp_path / "laptop"
    deployed_config = _repository(deployment)
    (deployment / "runs" / "models" / "arith").mkdir(parents=True)  # `modal volume put` put it there
    user_config = _repository(laptop)  # the user's runs/models/arith need not exist at all
    port = free_port()
    settings = control_settings(control_db_url, tmp_path).model_copy(
        update={"run_dir": deployment / "runs", "port": port, "max_prompt_set_bytes": 16 << 20,
                "max_body_bytes": 16 << 20})
    async with uvicorn_server(build_app(settings), port):
        url = f"http://127.0.0.1:{port}"
        code, out = await _submit(user_config, url, laptop / "runs")
        assert code == 0, out
        run_id = out.strip().splitlines()[-1]
        stored = await RunStore(control_redis).get(run_id)
        # what a deployed rollout server loaded from its own copy of the config: it serves this run
        container = load_run_config(deployed_config)
        assert serves_model(load_run_config(user_config), container.model.path) is False  # the user's path
        assert stored.config["model"]["path"] == str(container.model.path)
        from services.config import RunConfig

        assert serves_model(RunConfig.model_validate(stored.config), container.model.path)

        # a model the deployment does not have: 422 naming model.path, and no run
        other = _repository(tmp_path / "laptop-2", model="missing")
        await RunStore(control_redis).stop(run_id)
        code, out = await _submit(other, url, tmp_path / "laptop-2" / "runs")
        assert code != 0 and "422" in out and "model.path" in out, out
        assert str(deployment / "runs" / "models" / "missing") in out, out
        assert [r.run_id for r in await RunStore(control_redis).list(10)] == [run_id]
