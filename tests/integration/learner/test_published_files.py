"""A version's files hold that version's weights when they are written behind a broadcast (ZeRO-3).

On a GPU the learner gathers the published weights into host buffers it reuses at every publish
(``LearnerEngine._to_host``) and, with ``publish.transport = "broadcast"``, writes a version's files in
the background while it trains on; the next publish must not refill those buffers before the write is
done, or the version's files carry the next version's bytes (with a valid sha256, taken from the
file). ``bench/publish_versions.py`` runs the real ``Publisher`` on a ZeRO-3 ``LearnerEngine``, with
the GPU's buffer reuse forced on CPU, a step between two versions and every write held 1.5 s (a slow
disk), and compares each version's files with the weights it was published with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


def test_each_versions_files_hold_its_own_weights_when_the_next_publish_comes_first(tiny_model, tmp_path):
    out = tmp_path / "versions.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench/publish_versions.py"), "--reuse-buffers", "--versions", "2",
                           "--write-delay-s", "1.5", "--model", str(tiny_model), "--workdir", str(tmp_path),
                           "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["host_buffers"] and report["zero_stage"] == 3
    assert report["distinct_versions"] == 2  # the step moved the weights, so a mix-up shows
    assert report["mismatched"] == [], f"versions {report['mismatched']} hold the weights of a later version"
    assert proc.returncode == 0, proc.stderr[-4000:]
