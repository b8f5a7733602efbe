"""Prometheus metrics of the learner (served at ``/metrics``).

Gauges describe the latest step (loss, KL, entropy, clip fraction,
importance-weight statistics, gradient norm, tokens/s, the fraction of wall
time spent waiting for data); counters accumulate over the process's life
(groups and tokens trained, groups dropped as stale / zero-variance, dead
letters, versions published).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from learner.status import Published, Status


class LearnerMetrics:
    STEP_GAUGES = (
        "loss", "pg_loss", "kl", "entropy", "clip_fraction", "is_weight_mean", "is_weight_max",
        "is_capped_fraction", "grad_norm", "lr",
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step = Gauge("tandem_learner_step", "Optimizer steps taken.", registry=r)
        self.version = Gauge("tandem_learner_version", "Latest weight version published (v_learner).", registry=r)
        self.gauges = {
            name: Gauge(f"tandem_learner_{name}", f"{name} of the latest step.", registry=r) for name in self.STEP_GAUGES
        }
        self.tokens_per_s = Gauge("tandem_learner_tokens_per_second", "Training tokens/s of the latest step.", registry=r)
        self.idle_fraction = Gauge("tandem_learner_idle_fraction", "Fraction of wall time spent waiting for data.", registry=r)
        self.publish_s = Gauge("tandem_learner_publish_seconds", "Duration of the latest publish (gather + write + register).", registry=r)
        self.publish_gbps = Gauge("tandem_learner_publish_write_gb_per_second", "Write speed of the latest publish.", registry=r)
        self.tokens = Counter("tandem_learner_tokens", "Tokens trained.", registry=r)
        self.published = Counter("tandem_learner_versions_published", "Weight versions published.", registry=r)
        self.dropped = Gauge(
            "tandem_learner_groups_dropped", "Groups not trained, by reason (this process).", ["reason"], registry=r
        )

    def observe_step(self, status: Status, tokens: float) -> None:
        self.step.set(status.step)
        self.version.set(status.version)
        for name, g in self.gauges.items():
            value = status.last.get(name)
            if value is not None:
                g.set(value)
        self.tokens_per_s.set(status.tokens_per_s)
        self.idle_fraction.set(status.idle_fraction)
        self.tokens.inc(tokens)
        for reason, n in status.counts.items():
            self.dropped.labels(reason).set(n)

    def observe_publish(self, info: Published) -> None:
        self.version.set(info.version)
        self.publish_s.set(info.total_s)
        self.publish_gbps.set(info.write_gb_per_s)
        self.published.inc()
