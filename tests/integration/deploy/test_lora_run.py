"""``tandem run`` of a LoRA run that publishes adapters (``publish.lora_format = "adapter"``), as the
LoRA presets do: the learner writes each version as a PEFT adapter, the rollout server (started with
the run's config, so with vLLM's LoRA at ``learner.lora.r``) loads each one as an adapter, generates
with it and evaluates the final one. With the rollout engine started without LoRA (``lora_rank=None``
in ``rollout_server.app``, tried on a copy) the server refuses the run ("it publishes LoRA adapters
(rank 8); this server was started for full weights") and no step is ever trained."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.config import load_run_config
from tests.fixtures.stack import short_run_config

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


@pytest.mark.long
@pytest.mark.timeout(1500)  # the example's model built first, then the run: past the suite's 600 s under load
def test_adapter_run_serves_every_version_as_a_lora(tmp_path, arith_model):
    config_path = short_run_config(tmp_path, arith_model, steps=STEPS, checkpoint_every=STEPS, eval_prompts=8)
    text = re.sub(r"(?m)^\[publish\]\n", '[publish]\nlora_format = "adapter"\n', config_path.read_text())
    config_path.write_text(text + '\n[learner.lora]\nr = 8\nalpha = 16.0\n'
                                  'target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]\n')
    config = load_run_config(config_path)
    assert config.publish.lora_format == "adapter" and config.learner.lora.r == 8
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", str(config_path), "--runs", str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["steps"] == STEPS, summary["audit"]
    final = summary["final_version"]
    assert final == STEPS
    # the final version was served (the job makes the rollout server load it) and evaluated on it
    assert {e["version"] for e in summary["evals"]} >= {0, final}
    # every version on disk is an adapter, a small fraction of the model
    kept = sorted(p.parent for p in run_dir.rglob("tandem-version.json"))
    assert kept and all((v / "adapter_model.safetensors").is_file() and not (v / "model.safetensors").exists()
                        for v in kept), kept
    model_bytes = sum(f.stat().st_size for f in arith_model.glob("*.safetensors"))
    assert all((v / "adapter_model.safetensors").stat().st_size * 5 < model_bytes for v in kept)
    # and the rollout server loaded them as adapters
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("rollout*.log"))
    loaded = {int(v) for v in re.findall(r"loaded weight version (\d+) from ", logs)}
    assert final in loaded, logs[-3000:]
    assert "does not fit the served model" not in logs and "not a PEFT adapter" not in logs
