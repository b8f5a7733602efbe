"""Every Redis key tandem uses, in one place.

All keys of a run live under ``tandem:run:{run_id}:``, so several runs share
one Redis without interfering and a run is removed by deleting its prefix.
Keys that are not per run (prompt sets, the run index) live under
``tandem:``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "tandem"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# Consumer-group names on the two streams.
ROLLOUT_GROUP = "rollout"
LEARNER_GROUP = "learner"


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a safe key component, else raise ``ValueError``."""
    if not _RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
        )
    return run_id


@dataclass(frozen=True)
class Keys:
    """Key names of one run."""

    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    def _k(self, name: str) -> str:
        return f"{PREFIX}:run:{self.run_id}:{name}"

    @property
    def prompts(self) -> str:
        """Stream of prompt-group requests (control plane -> rollout servers)."""
        return self._k("prompts")

    @property
    def trajectories(self) -> str:
        """Stream of scored trajectory groups (rollout servers -> learner)."""
        return self._k("trajectories")

    def dead(self, stream: str) -> str:
        """Dead-letter stream for entries of ``stream`` that could not be processed."""
        return f"{stream}:dead"

    def done(self, stream: str) -> str:
        """Set of group ids whose processing on ``stream`` is finished (idempotency)."""
        return f"{stream}:done"

    @property
    def tickets(self) -> str:
        """Sorted set group_id -> lease deadline: groups admitted and not yet consumed."""
        return self._k("tickets")

    @property
    def counters(self) -> str:
        """Hash of accounting counters (stale_dropped, dead_lettered, ...)."""
        return self._k("counters")

    @property
    def weights_latest(self) -> str:
        """The newest published weight version (msgpack record)."""
        return self._k("weights:latest")

    @property
    def weights_history(self) -> str:
        """Hash version -> record of every published version still kept."""
        return self._k("weights:history")

    @property
    def weights_channel(self) -> str:
        """Pub/sub channel announcing each publish (payload: the version number)."""
        return self._k("weights:published")

    @property
    def weights_in_use(self) -> str:
        """Hash server_id -> 'version:timestamp' of the version each rollout server serves."""
        return self._k("weights:in-use")

    @property
    def weights_retracted(self) -> str:
        """Set of version numbers withdrawn at a learner resume (published after the checkpoint it restored)."""
        return self._k("weights:retracted")

    @property
    def weights_members(self) -> str:
        """Hash server_id -> '[workers, timestamp]': rollout servers ready to join a weight broadcast
        (``broker.broadcast``), renewed as a heartbeat."""
        return self._k("weights:members")

    @property
    def weights_broadcast(self) -> str:
        """String: the newest broadcast announcement (``broker.broadcast.Announcement`` JSON)."""
        return self._k("weights:broadcast")

    @property
    def weights_broadcast_channel(self) -> str:
        """Pub/sub channel: the version number of each new broadcast announcement."""
        return self._k("weights:broadcasting")

    @property
    def ledger(self) -> str:
        """Stream of every prompt group's life and every version event (``broker.ledger``)."""
        return self._k("ledger")

    @property
    def state(self) -> str:
        """Hash of the run's record (``services.runs.RunStore``: state, step, policy version, ...)."""
        return self._k("state")

    @property
    def metrics(self) -> str:
        """Stream of metric points of the run (time series)."""
        return self._k("metrics")

    @property
    def completions(self) -> str:
        """Stream of the completions table (``services.runs.CompletionsLog``: a few trained samples per step)."""
        return self._k("completions")

    @property
    def metrics_summary(self) -> str:
        """Hash ``last:NAME`` / ``first:NAME`` / ``max:NAME`` -> value over the metrics stream."""
        return self._k("metrics:summary")

    @property
    def eval_prompts(self) -> str:
        """List of the run's held-out prompts (msgpack), stored by the control plane at run start."""
        return self._k("eval:prompts")

    @property
    def evals(self) -> str:
        """Hash of held-out evaluations: ``claim:V`` -> who evaluates version V, ``point:V`` -> its result (JSON)."""
        return self._k("evals")

    @property
    def learner_lease(self) -> str:
        """String: the id of the learner training this run, with a TTL it renews (``broker.lease``)."""
        return self._k("learner:lease")

    @property
    def timeline(self) -> str:
        """Stream of spans of work and waiting from every service (``services.timeline``), capped ~."""
        return self._k("timeline")

    @property
    def heartbeats(self) -> str:
        """Hash service -> Unix time of its last heartbeat (``services.timeline``; ``control_plane.stalls``)."""
        return self._k("heartbeats")

    @property
    def cpu(self) -> str:
        """String: the run's CPU account (JSON of ``services.wire.CpuAccount``), rewritten every few seconds
        by the stack that runs the services (``deploy.cpu_account``)."""
        return self._k("cpu")

    @property
    def incidents(self) -> str:
        """Stream of watchdog incidents (a call that outlived its bound: what, waited, limit, action)."""
        return self._k("incidents")


def prompt_set(prompt_set_id: str) -> str:
    """Stream-free storage of an uploaded prompt set (a list of encoded lines)."""
    return f"{PREFIX}:prompt-set:{check_run_id(prompt_set_id)}"


def prompt_set_meta(prompt_set_id: str) -> str:
    """Hash describing a stored prompt set (count, bytes, created_at, reward types)."""
    return f"{PREFIX}:prompt-set-meta:{check_run_id(prompt_set_id)}"


RUNS = f"{PREFIX}:runs"
"""Sorted set run_id -> creation time: every run the control plane knows."""

PROMPT_SETS = f"{PREFIX}:prompt-sets"
"""Sorted set prompt_set_id -> upload time: every stored prompt set."""

AUTOSCALER = f"{PREFIX}:autoscaler"
"""Hash: the rollout autoscaler's state between its ticks (``deploy.autoscale``: containers set,
consecutive ticks asking for more or fewer, last change, stale drops seen)."""

ACTIVE_RUN = f"{PREFIX}:active-run"
"""String: the id of the run the stack works on (queued or running); absent when idle."""
