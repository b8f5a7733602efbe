"""Prometheus metrics of a rollout server, in the app's own registry.

Tokens/s is ``rate(tandem_rollout_generated_tokens_total[1m])``. Running and
waiting requests and KV-cache use come from vLLM's scheduler through a stat logger
(:func:`stat_logger_factory`), the hook vLLM offers for custom metrics, where the server's
``engine_stats`` setting asks for them (off by default: they cost CPU at every step).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.generated_tokens = Counter(
            "tandem_rollout_generated_tokens", "Completion tokens generated.", registry=registry
        )
        self.prompt_tokens = Counter("tandem_rollout_prompt_tokens", "Prompt tokens processed.", registry=registry)
        self.requests = Counter(
            "tandem_rollout_requests", "Generate calls by outcome.", ["source", "outcome"], registry=registry
        )
        self.running = Gauge("tandem_rollout_running_requests", "Sequences the engine is running.", registry=registry)
        self.waiting = Gauge("tandem_rollout_waiting_requests", "Sequences waiting in the engine.", registry=registry)
        self.kv_cache_usage = Gauge("tandem_rollout_kv_cache_usage", "KV-cache fraction in use.", registry=registry)
        self.pending_seqs = Gauge(
            "tandem_rollout_pending_http_seqs", "Sequences of HTTP requests in flight.", registry=registry
        )
        self.version = Gauge("tandem_rollout_policy_version", "Loaded weight version.", registry=registry)
        self.reload_s = Histogram(
            "tandem_rollout_reload_seconds",
            "Time to load a weight version (verify + pause/drain + reload).",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=registry,
        )
        self.reloads = Counter("tandem_rollout_reloads", "Weight loads by outcome.", ["outcome"], registry=registry)
        self.mixed_version_samples = Counter(
            "tandem_rollout_mixed_version_samples",
            "Samples whose tokens came from more than one weight version (tagged with the oldest).",
            registry=registry,
        )
        self.engine_up = Gauge("tandem_rollout_engine_up", "1 while the engine is alive.", registry=registry)
        # actor loop
        self.groups = Counter(
            "tandem_rollout_groups", "Prompt groups by outcome (actor loop).", ["outcome"], registry=registry
        )
        self.admission = Counter(
            "tandem_rollout_admission", "Admission decisions (actor loop).", ["reason"], registry=registry
        )
        self.group_gen_s = Histogram(
            "tandem_rollout_group_generate_seconds",
            "Generation time of one prompt group.",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.groups_in_flight = Gauge("tandem_rollout_groups_in_flight", "Groups the actor is working on.", registry=registry)
        # episodes (rollout_server.episodes, rollout_server.tools)
        self.tool_calls = Counter(
            "tandem_rollout_tool_calls", "Episode tool calls by tool and outcome (ok, error, timeout, refused).",
            ["tool", "outcome"], registry=registry,
        )
        self.tool_call_s = Histogram(
            "tandem_rollout_tool_call_seconds", "Time to answer one episode tool call (the observation's wait).",
            ["tool"], buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )


def stat_logger_factory(metrics: RolloutMetrics):
    """A vLLM ``StatLoggerFactory`` that copies scheduler stats into ``metrics``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SchedulerGauges(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                metrics.running.set(scheduler_stats.num_running_reqs)
                metrics.waiting.set(scheduler_stats.num_waiting_reqs)
                metrics.kv_cache_usage.set(scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self) -> None:
            pass

    return _SchedulerGauges
