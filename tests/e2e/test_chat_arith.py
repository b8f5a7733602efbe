"""The chat example end to end, by the commands docs/tutorial.md gives: examples/chat_arith/walkthrough.sh.

The script runs in a temporary directory with a copy of examples/chat_arith/run.toml whose paths
point there, and the session's arith model (``arith_model``, which the other end-to-end tests use
too) where the chat bootstrap looks for it (``runs/models/arith``). It writes the Parquet dataset,
builds the chat policy from the arith model, starts ``tandem up`` with the reward function on the
reward server's ``PYTHONPATH`` and allowed by ``TANDEM_REWARD_FUNCTIONS``, imports both splits with
``tandem prompts import``, trains with ``tandem submit --prompt-set``, waits with ``tandem status
--watch``, exports the best version with ``tandem export`` and stops the stack. Then:

- held-out mean@4 and pass@4, read back from the run's TensorBoard events, rose from version 0 to
  the last evaluated version (30 or 40: the final version's evaluation may come after the stack
  stopped) by more than :data:`MEAN_MARGIN` and :data:`PASS_MARGIN`;
- the export loads with transformers (model and tokenizer, with the chat template) and, rendering
  held-out conversations with that template and decoding greedily, answers more than
  :data:`GREEDY_MARGIN` more of them than the chat policy it started from. This check knows the
  sums itself: the run's own figures are scored by the reward function under test, and with one
  broken to pay for the answer ten short they rose too (docs/tutorial.md, "The test");
- nothing the stack started is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.processes import die_with_parent, group_members

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "chat_arith"
MEAN_MARGIN, PASS_MARGIN, GREEDY_MARGIN = 0.15, 0.10, 0.30
"""Least rises: held-out mean@4 and pass@4 from version 0 to the last evaluated version, and greedy
accuracy from the chat policy to the export. Three runs of the walk-through rose by 0.266-0.300,
0.210-0.230 and 0.550-0.565 (docs/tutorial.md, "The measurements")."""
TIMEOUT_S = 900
"""The walk-through took 198-427 s on 2 cores at load 7-20 (docs/tutorial.md)."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _scalars(events_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 600)  # and the session's arith model, if this test is the first to need it
def test_the_chat_walkthrough_learns_logs_and_exports(tmp_path, arith_model):
    from examples.chat_arith.bootstrap import greedy_accuracy
    from services.config import load_run_config

    config = tmp_path / "run.toml"
    config.write_text((EXAMPLE / "run.toml").read_text().replace('"../../runs/', '"runs/'))
    assert load_run_config(config).model.path == tmp_path / "runs/models/chat_arith"
    (tmp_path / "runs/models").mkdir(parents=True)
    (tmp_path / "runs/models/arith").symlink_to(arith_model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    env.update(CONFIG=str(config), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    log = tmp_path / "walkthrough.log"
    t0 = time.monotonic()
    script = subprocess.Popen([str(EXAMPLE / "walkthrough.sh")], cwd=tmp_path, env=env, stdout=open(log, "wb"),
                              stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    code = None
    try:
        code = script.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGTERM)  # tandem up too (its process group); the script's trap waits
            try:
                script.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(script.pid, signal.SIGKILL)
                script.wait()
    output = log.read_text(errors="replace")
    print(output[-4000:], f"\nwalkthrough: {time.monotonic() - t0:.0f} s")
    ended = f"ran past {TIMEOUT_S} s" if code is None else f"exited {code}"
    assert code == 0, f"the walk-through {ended}:\n{output[-4000:]}"

    info = json.loads((tmp_path / "runs/stack/stack.json").read_text())
    assert not [p for p in info["pids"] if _alive(p)], "a service outlived the walkthrough"
    assert not [p for pgid in info["pids"] for p in group_members(pgid)], "a service's process outlived it"

    (run_dir,) = [p for p in (tmp_path / "runs/stack").iterdir() if (p / "trackers").is_dir()]
    run_id = run_dir.name
    events = run_dir / "trackers" / "tensorboard" / run_id
    assert list(events.glob("events.out.tfevents.*")), "no TensorBoard event file"
    scalars = _scalars(events)
    mean, pass_4 = scalars["eval/accuracy"], scalars["eval/pass_at_4"]
    first, last = 0, max(mean)
    assert last >= 30 and set(range(0, last + 1, 10)) <= set(mean), sorted(mean)
    print(f"held-out mean@4 {mean[first]:.3f} -> {mean[last]:.3f}, pass@4 {pass_4[first]:.3f} -> {pass_4[last]:.3f} "
          f"(versions 0 -> {last}); train/reward_mean {scalars['train/reward_mean']}")
    assert mean[last] > mean[first] + MEAN_MARGIN, (mean, pass_4)
    assert pass_4[last] > pass_4[first] + PASS_MARGIN, (mean, pass_4)

    export = tmp_path / "runs/chat_arith/export"
    meta = json.loads((export / "tandem-export.json").read_text())
    assert meta["run_id"] == run_id
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(export).chat_template
    held_out = tmp_path / "runs/chat_arith/eval.parquet"
    before = greedy_accuracy(tmp_path / "runs/models/chat_arith", held_out)
    after = greedy_accuracy(export, held_out)
    print(f"exported version {meta['version']}: greedy held-out accuracy {before:.2f} -> {after:.2f} (transformers)")
    assert after > before + GREEDY_MARGIN
