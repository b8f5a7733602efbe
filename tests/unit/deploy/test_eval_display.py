"""The newest held-out evaluation, as ``tandem status`` and ``tandem run``'s progress bar show it."""

from __future__ import annotations

from rich.console import Console

from deploy.main_job import _progress_note
from deploy.report import status_table
from services import wire
from services.config import EvalConfig
from services.evaluate import due


def _status(point: wire.EvalPoint | None) -> wire.RunStatus:
    return wire.RunStatus(
        run=wire.RunRecord(run_id="r", state="running", prompt_set_id="ps-x", config={}, created_at=0.0,
                           step=23, policy_version=23),
        reward_mean=0.5, accuracy=point.accuracy if point else None, accuracy_first=0.62, eval=point,
        weights_version=23,
        staleness=wire.Staleness(max_staleness=1, max_observed_lag=1.0, stale_dropped=0, queued=0, in_flight=0,
                                 backlog=0),
        throughput=wire.Throughput(rollout_tokens_per_s=None, learner_tokens_per_s=None, rollout_idle_frac=None,
                                   learner_idle_frac=None),
        counters={},
    )


def test_status_and_progress_bar_show_the_newest_eval_and_its_version():
    st = _status(wire.EvalPoint(version=20, accuracy=0.84, count=200, by="rollout-0"))
    console = Console(record=True, width=200)
    console.print(status_table(st))
    assert "62.0% -> 84.0% (version 20)" in console.export_text()
    assert _progress_note(st).endswith("eval 84.0% (v20)")
    assert "eval" not in _progress_note(_status(None))


def test_due_versions():
    every10 = EvalConfig(every=10)
    assert [v for v in range(31) if due(v, every10)] == [0, 10, 20, 30]
    assert [v for v in range(31) if due(v, EvalConfig(before=False))] == []
