"""A run's CPU account as the status route computes it per trained sample and ``tandem status`` shows it."""

from __future__ import annotations

import pytest
from rich.console import Console

from deploy.cpu_account import minus
from deploy.report import status_table
from services import wire


def _status(cpu: wire.CpuAccount | None) -> wire.RunStatus:
    return wire.RunStatus(
        run=wire.RunRecord(run_id="r", state="running", prompt_set_id="ps-x", config={}, created_at=0.0,
                           step=3, policy_version=3),
        reward_mean=0.5, accuracy=None, accuracy_first=None, weights_version=3,
        staleness=wire.Staleness(max_staleness=1, max_observed_lag=1.0, stale_dropped=0, queued=0, in_flight=0,
                                 backlog=0),
        throughput=wire.Throughput(rollout_tokens_per_s=None, learner_tokens_per_s=None, rollout_idle_frac=None,
                                   learner_idle_frac=None),
        counters={}, cpu=cpu)


ACCOUNT = wire.CpuAccount(at=1.0, services={
    "rollout": wire.ServiceCpu(cpu_s=6.0, processes={"python": 2.0, "VLLM::EngineCor": 4.0}),
    "learner": wire.ServiceCpu(cpu_s=3.0, processes={"python": 3.0}),
    "redis": wire.ServiceCpu(cpu_s=0.6, processes={"redis-server": 0.6})})


def test_per_sample_figures_and_the_status_line():
    per = ACCOUNT.per_sample(300)
    assert per.samples_trained == 300 and per.per_sample_s == pytest.approx(9.6 / 300)
    assert per.services["rollout"].per_sample_s == pytest.approx(0.02)
    assert per.services["redis"].processes == {"redis-server": 0.6}
    console = Console(record=True, width=200)
    console.print(status_table(_status(per)))
    assert "0.032 (rollout 0.02, learner 0.01, redis 0.002)" in console.export_text()

    before = ACCOUNT.per_sample(0)  # nothing trained yet: seconds, no division by zero
    assert before.per_sample_s is None and before.services["learner"].per_sample_s is None
    console = Console(record=True, width=200)
    console.print(status_table(_status(before)))
    assert "no sample trained yet; CPU-s so far: rollout 6.0, learner 3.0, redis 0.6" in console.export_text()

    console = Console(record=True, width=200)
    console.print(status_table(_status(None)))  # no stack runs the services: no line
    assert "CPU" not in console.export_text()


def test_an_account_is_the_reading_minus_the_reading_when_the_run_began():
    base = {"rollout": {"python": 10.0}, "learner": {"python": 5.0}}
    now = {"rollout": {"python": 12.5, "VLLM::EngineCor": 3.0}, "learner": {"python": 5.0}, "stack": {"stack": 1.0}}
    assert minus(now, base) == {"rollout": {"python": 2.5, "VLLM::EngineCor": 3.0}, "learner": {"python": 0.0},
                                "stack": {"stack": 1.0}}
