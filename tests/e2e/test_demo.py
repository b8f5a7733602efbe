"""`tandem demo` (the broker demo: producers, a consumer, the staleness rule) end to end."""

from __future__ import annotations

import os
import subprocess
import sys


def _demo(tmp_path, env_extra: dict, eta: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TANDEM_REDIS_URL")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "--steps", "8", "--max-staleness", str(eta),
         "--run-dir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_demo_with_embedded_redis(tmp_path):
    out = _demo(tmp_path, {}, eta=1)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "invariants hold" in out.stdout and "embedded redis-server" in out.stdout
    assert (tmp_path / "demo" / "redis" / "appendonlydir").is_dir()


def test_demo_on_policy_against_external_redis(tmp_path, redis_url):
    out = _demo(tmp_path, {"REDIS_URL": redis_url}, eta=0)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"broker: {redis_url} (REDIS_URL)" in out.stdout
    assert not (tmp_path / "demo" / "redis").exists()
    lines = [ln for ln in out.stdout.splitlines() if "stale_dropped" in ln or "max_observed_lag" in ln]
    assert all(ln.split("│")[2].strip() == "0" for ln in lines), lines
