"""`tandem run` with publish.transport = "broadcast": the real stack (Redis, control plane, reward server, vLLM
rollout server, DeepSpeed learner) on the session's tiny model. Every version reaches the rollout server in
memory (ledger: broadcast -> received; none loaded from its files), the files are written behind the
learner, and the run audits clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from host.processes import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400
CONFIG = """
name = "bcast"

[model]
path = "{model}"
max_model_len = 128
dtype = "float32"

[data]
train = "{root}/examples/arith/train.jsonl"
eval = "{root}/examples/arith/eval.jsonl"

[sampling]
group_size = 4
max_tokens = 8

[reward]
type = "exact"
extract = "answer_tag"

[loss]
filter_zero_variance = false  # a random model scores 0 everywhere: keep its groups, there is nothing to learn

[learner]
groups_per_step = 2
steps = 3
checkpoint_every = 2

[publish]
transport = "broadcast"

[eval]
before = false
max_prompts = 4
"""


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_broadcast_run_serves_every_version_from_memory(tmp_path, tiny_model):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(model=tiny_model, root=ROOT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(config), "--runs", str(tmp_path / "runs")],
                            cwd=tmp_path, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_parent)
    code = None
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # tandem run stops its stack on SIGTERM
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = log.read_text(errors="replace")
    assert code == 0, f"tandem run {'ran past the timeout' if code is None else f'exited {code}'}:\n{output[-4000:]}"
    assert "audit: ok" in output, output[-2000:]

    (run,) = [p for p in (tmp_path / "runs").glob("*/bcast-*") if p.is_dir()]
    published = [json.loads(x) for x in (run / "learner" / "published.jsonl").read_text().splitlines()]
    assert [p["version"] for p in published] == [1, 2, 3]
    assert [p["broadcast_to"] for p in published] == [1, 1, 1]
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    events = [(e["e"], e["d"]["version"]) for e in ledger if e["e"] in ("broadcast", "received", "loaded", "published")]
    for v in (1, 2, 3):  # the files' registry entry may land before or after the server's swap ('received')
        assert events.index(("broadcast", v)) < min(events.index(("received", v)), events.index(("published", v))), events
    assert not [e for e in events if e[0] == "loaded"], "a version came from its files"
