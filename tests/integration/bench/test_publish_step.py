"""bench/publish_step.py, the learner's step against its publish for both transports, runs end to end on the tiny
model: a real DeepSpeed step, the files written, a real Broadcaster to a member process over gloo via Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
def test_publish_step_bench_times_both_transports_and_the_member_gets_every_broadcast(tmp_path):
    out = tmp_path / "publish-step.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench/publish_step.py"), "--tiny", "--rounds", "2",
                           "--workdir", str(tmp_path), "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]  # the script asserts every broadcast was sent
    report = json.loads(out.read_text())
    assert [r["version"] for r in report["rounds"]["files"]] == [1, 2]
    assert [r["version"] for r in report["rounds"]["broadcast"]] == [3, 4]
    # the member received versions 3 and 4, each with the digest it checked against the learner's
    assert [line.split()[0] for line in report["member"]] == ["3", "4"]
    assert set(report["summary"]["files"]["parts_s"]) == {"gather_s", "write_s"}
    assert set(report["summary"]["broadcast"]["parts_s"]) == {"gather_s", "wait_write_s", "send_s", "clone_s"}
    for s in report["summary"].values():
        assert s["step_s"] > 0 and s["blocked_s"] > 0 and s["blocked_frac"] == pytest.approx(s["blocked_s"] / s["step_s"], rel=0.05)
    assert report["rounds"]["broadcast"][-1]["background_write_s"] > 0  # the last version's files were written
