"""``TANDEM_RUN_DIR`` and ``--run-dir`` agree (docs/architecture.md section 8): `tandem up` without
``--run-dir`` puts its stack (stack.json, logs, Redis data) in ``TANDEM_RUN_DIR``, and the clients find it
there. Before, `tandem up` wrote to runs/stack whatever the variable said."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.processes import stop_group

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
def test_up_and_the_clients_use_tandem_run_dir_when_no_flag_is_given(tmp_path):
    run_dir = tmp_path / "mine"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    env["TANDEM_RUN_DIR"] = str(run_dir)
    log = tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--only", "control"], cwd=tmp_path, env=env,
                          stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "stack.json").exists():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert not (tmp_path / "runs").exists()
        assert (run_dir / "logs" / "control.log").exists()
        # no --url, no TANDEM_URL: the client reads the stack's URL and token from TANDEM_RUN_DIR/stack.json
        runs = subprocess.run([sys.executable, "-m", "deploy.cli", "runs"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert runs.returncode == 0, runs.stderr
        assert "runs" in runs.stdout
    finally:
        stop_group(up)
