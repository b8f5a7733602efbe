"""The newest held-out evaluation, as ``tandem status`` and ``tandem run``'s progress bar show it."""

from __future__ import annotations

from rich.console import Console

from deploy.main_job import _progress_note
from deploy.report import eval_text, status_table
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


def test_several_samples_show_mean_at_n_and_pass_at_k():
    point = wire.EvalPoint(version=20, accuracy=0.45, count=200, by="rollout-0", samples=8,
                           pass_at={1: 0.45, 2: 0.6, 4: 0.7, 8: 0.8})
    st = _status(point)
    console = Console(record=True, width=200)
    console.print(status_table(st))
    text = console.export_text()
    assert "62.0% -> 45.0% (version 20)" in text  # accuracy keeps its place: mean@8 now
    assert "mean@8 45.0%, pass@1 45.0%, pass@2 60.0%, pass@4 70.0%, pass@8 80.0% (version 20)" in text
    assert _progress_note(st).endswith("eval mean@8 45.0%, pass@8 80.0% (v20)")
    one = wire.EvalPoint(version=20, accuracy=0.84, count=200)
    console = Console(record=True, width=200)
    console.print(status_table(_status(one)))
    assert "pass@" not in console.export_text() and "mean@" not in console.export_text()


def test_summary_fields_of_one_and_of_several_samples():
    from deploy.main_job import eval_fields

    def point(version: int, **values: float) -> wire.MetricPoint:
        return wire.MetricPoint(id=f"{version}-0", t=0.0, source="eval", step=version, values=values)

    greedy = [point(0, accuracy=0.3, count=10, held_out_reward=0.3), point(5, accuracy=0.7, count=10, held_out_reward=0.7)]
    after = wire.EvalPoint(version=5, accuracy=0.7, count=10, reward_mean=0.7)
    assert eval_fields(greedy, after, 1) == {
        "accuracy_before": 0.3, "accuracy_after": 0.7, "held_out_reward_before": 0.3, "held_out_reward_after": 0.7,
        "eval_prompts": 10, "eval_samples": 1, "pass_at_before": None, "pass_at_after": None,
        "evals": [{"version": 0, "accuracy": 0.3, "held_out_reward": 0.3},
                  {"version": 5, "accuracy": 0.7, "held_out_reward": 0.7}]}
    # a reward model's held-out score: rewards that are not 0 or 1, so no completion counts as correct
    judged = [point(0, accuracy=0.0, count=10, held_out_reward=0.48), point(5, accuracy=0.0, count=10, held_out_reward=0.93)]
    after = wire.EvalPoint(version=5, accuracy=0.0, count=10, reward_mean=0.93)
    fields = eval_fields(judged, after, 1)
    assert (fields["held_out_reward_before"], fields["held_out_reward_after"]) == (0.48, 0.93)
    assert eval_text(after) == "0.0%, reward 0.93" and eval_text(wire.EvalPoint(version=5, accuracy=0.7, count=10,
                                                                                reward_mean=0.7)) == "70.0%"
    sampled = [point(0, accuracy=0.3, count=10, samples=4, pass_at_1=0.3, pass_at_2=0.45, pass_at_4=0.6, pass_at_n=0.6),
               point(5, accuracy=0.7, count=10, samples=4, pass_at_1=0.7, pass_at_2=0.8, pass_at_4=0.9, pass_at_n=0.9)]
    after = wire.EvalPoint(version=5, accuracy=0.7, count=10, samples=4, pass_at={1: 0.7, 2: 0.8, 4: 0.9})
    fields = eval_fields(sampled, after, 4)
    assert (fields["accuracy_before"], fields["accuracy_after"], fields["eval_samples"]) == (0.3, 0.7, 4)
    assert fields["pass_at_before"] == {1: 0.3, 2: 0.45, 4: 0.6} and fields["pass_at_after"] == {1: 0.7, 2: 0.8, 4: 0.9}
    assert fields["evals"][1] == {"version": 5, "accuracy": 0.7, "held_out_reward": None,
                                  "pass_at": {1: 0.7, 2: 0.8, 4: 0.9}}


def test_dropped_counts_every_dropped_group_by_reason():
    """The progress line's and ``tandem status``'s ``dropped``: every group dropped, by reason, the rollout
    side's dead letters (reward failures apart) with the learner's drops. Before: stale drops only (0 while a
    reward that always failed dropped every group)."""
    counters = {"stale_dropped": 2, "zero_variance_dropped": 5, "infra_dropped": 3, "dead_lettered": 4,
                "accepted": 10, "produced": 12}
    st = _status(None).model_copy(update={"counters": counters})
    assert st.dropped() == {"stale": 2, "zero_variance": 5, "infra": 3, "dead_lettered": 1}
    assert "dropped 11 (dead_lettered 1, infra 3, stale 2, zero_variance 5)" in _progress_note(st)
    console = Console(record=True, width=200)
    console.print(status_table(st))
    assert "11 (dead_lettered 1, infra 3, stale 2, zero_variance 5)" in console.export_text()
    assert "dropped 0 " in _progress_note(_status(None)) + " "
