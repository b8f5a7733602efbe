"""Experiment trackers: a run's config, metrics and completions table in TensorBoard, Weights & Biases and MLflow.

Where this runs, and why there: in the control plane, one follower per control plane
(:class:`TrackerHub`, started by its lifespan). Every run, whether ``tandem run`` started it
or ``tandem submit`` on a ``tandem up`` stack, is created by the control plane's ``POST
/v1/runs``, so that is where a tracker that cannot start can refuse the run before anything
trains (422 naming the tracker), and the control plane already reads each run's metrics for
the dashboard. The learner, the rollout servers and the evaluator need not know trackers exist:
they append to the run's metrics stream (``services.runs.MetricsLog``) as before, and the hub
reads that stream from a cursor and logs each point. The tracker libraries are imported only
by a control plane whose runs ask for them, and their calls run in a worker thread, so the
event loop keeps serving the API and the dashboard.

A run's trackers:

- are opened by ``POST /v1/runs`` (:meth:`TrackerHub.open`) before the run is registered;
  a library that is missing, a bad setting (an MLflow URI nobody answers, W&B online without an
  API key) fails the creation with the tracker's own error, and no run exists;
- log the run config once, flattened to dotted keys (``learner.lr``), as hyperparameters
  (TensorBoard's hparams plugin, W&B's run config, MLflow's params);
- log every metric point the run's stream holds, as ``<group>/<name>`` at the point's step: group
  ``train`` for the learner (reward, loss, KL, entropy, clip fraction, importance weights, grad
  norm, lr, lag, stale and zero-variance drops, tokens/s, idle fraction: ``learner.trainer``'s
  point), ``eval`` for held-out evaluation (step = the version evaluated; accuracy and whatever
  else the evaluator records), and the rollout server's id (``rollout``, ``rollout-2``: tokens/s,
  idle fraction; step = the version it serves). Metrics added to the stream later (reward
  components) are logged too, under their own names. In W&B each group has its own step
  metric (``train/step``, ``eval/step``, ...), since the groups' steps do not rise together;
- log the run's completions table (``services.runs.CompletionsLog``, ``logging.completions`` rows per
  learner step; TRL's ``log_completions``), followed from a cursor of its own, with columns step, prompt,
  completion, reward, advantage and each column reward functions logged: per learner step a markdown table
  as TensorBoard text (tag ``completions``) and a ``wandb.Table`` under ``completions`` (against
  ``train/step``), and MLflow's ``log_table`` appending to the run's ``completions.json`` artifact;
- are closed when the run has ended and no point came for ``logging.close_after_s`` (the main
  job's final evaluation comes after the learner finishes), when another run becomes active, or
  when the control plane stops (W&B's run finishes with exit code 1 if the run failed; MLflow's
  becomes FINISHED, FAILED or KILLED for a stopped run; one still running stays RUNNING).

A tracker whose call raises mid-run is reported (a log line and an incident of the run, which
``tandem status`` and the dashboard show) and dropped for the rest of the run; the other
trackers and training go on. The hub follows the newest run: the active one, or the last run
if none is active. A control plane restarted mid-run (or after the run ended, before its trackers
were closed) opens that run's trackers again (W&B resumes the run of the same id, MLflow the run
tagged with the run id, TensorBoard adds an event file) and goes on from the cursors in
``<dir>/<run_id>.cursor`` and ``<dir>/<run_id>.completions.cursor`` (a point or row logged just before
a crash may be logged twice); trackers closed after their run ended leave ``<dir>/<run_id>.closed``
and are not opened again.

What a run's config may choose is bounded by the operator: ``logging.dir`` stays under the control
plane's run directory, and ``logging.mlflow_tracking_uri`` must be one of
``TANDEM_CONTROL_MLFLOW_TRACKING_URIS`` (422 naming the field otherwise), since whoever may submit a
run would otherwise choose where the control plane writes and what it connects to.

Files (``logging.dir``, default ``<run dir>/<run_id>/trackers``): ``tensorboard/<run_id>/``
(event files), ``wandb/`` (W&B's run files; offline runs upload with ``wandb sync``),
``mlflow.db`` (MLflow's default store here: SQLite, since MLflow 3 refuses its plain file store
unless ``MLFLOW_ALLOW_FILE_STORE=true``; artifacts in ``mlflow-artifacts/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import get_args

from broker import Keys
from broker.streams import raise_if_cancelled
from services.app import ServiceError
from services.config import LoggingConfig, RunConfig, parse_run_config
from services.run_states import TERMINAL_STATES
from services.runs import CompletionsLog, MetricsLog, RunStore
from services.watchdog import IncidentLog, incident
from services.wire import CompletionRow, MetricPoint

log = logging.getLogger("tandem.trackers")

TRACKERS: tuple[str, ...] = get_args(get_args(LoggingConfig.model_fields["trackers"].annotation)[0])
"""The trackers ``logging.trackers`` may name, each imported as the module of the same name."""
SOURCE = "control:trackers"
"""Who records a tracker's incidents."""
STOP_WAIT_S = 10.0
"""How long a stopping control plane lets a poll in progress (a tracker opening) finish."""
READ_BATCH = 1000
"""Metric points (or completions rows) read from the stream (and handed to the trackers) at a time."""
COMPLETION_COLUMNS = ("step", "prompt", "completion", "reward", "advantage")
"""The completions table's own columns; those reward functions logged follow."""
_KEY = re.compile(r"[^A-Za-z0-9_.-]")
_MLFLOW_PARAMS = 100  # per log_batch call (MLflow's limit)
_MLFLOW_METRICS = 1000
_MLFLOW_PARAM_CHARS = 6000


class TrackerError(Exception):
    """A tracker that cannot start; the message names it and says why."""


def preflight(config: RunConfig) -> None:
    """Raise :class:`TrackerError` if a tracker the config names is not installed here (cheap: no import)."""
    missing = [name for name in config.logging.trackers if importlib.util.find_spec(name) is None]
    if missing:
        raise TrackerError(f"logging.trackers: {', '.join(missing)} not installed here "
                           "(make extras, or pip install -e '.[trackers]' in the checkout)")


def flatten(config: dict, prefix: str = "") -> dict[str, str | int | float | bool]:
    """``{"learner": {"lr": 1e-5}}`` -> ``{"learner.lr": 1e-05}``; lists and None become strings."""
    out: dict[str, str | int | float | bool] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + ".")
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


def group_of(source: str) -> str:
    """The name group of a metric point's source: ``train``, ``eval`` or the rollout server's id."""
    if source == "learner":
        return "train"
    if source.startswith("rollout:"):
        return _KEY.sub("_", source.removeprefix("rollout:")) or "rollout"
    return _KEY.sub("_", source)


def tracker_dir(config: RunConfig, run_dir: Path, run_id: str) -> Path:
    """Where the run's tracker files go: ``logging.dir`` taken from ``run_dir``, which it must stay
    under once resolved (symlinks and ``..`` followed); :class:`TrackerError` naming the field if not.

    The run config comes from whoever may submit a run, not only the operator: a directory of their
    choosing would let them make the control plane create and write files anywhere it can."""
    root = Path(run_dir).resolve()
    chosen = config.logging.dir
    where = root / run_id / "trackers" if chosen is None else (root / chosen).resolve()
    if not where.is_relative_to(root):
        raise TrackerError(f"logging.dir: {chosen} is outside the control plane's run directory {root}: "
                           "give a path under it (a relative one is taken from it)")
    return where


def check_mlflow_uri(config: RunConfig, allowed: list[str]) -> None:
    """Raise :class:`TrackerError` if ``logging.mlflow_tracking_uri`` is set and is not one of
    ``allowed`` (the operator's ``TANDEM_CONTROL_MLFLOW_TRACKING_URIS``, compared up to a trailing
    slash): MLflow would send requests to any URL, or open an SQLite file at any path, it names."""
    uri = config.logging.mlflow_tracking_uri
    if uri is not None and uri.rstrip("/") not in {u.rstrip("/") for u in allowed}:
        offered = ", ".join(allowed) if allowed else "none: this control plane allows none"
        raise TrackerError(f"logging.mlflow_tracking_uri: {uri} is not one of TANDEM_CONTROL_MLFLOW_TRACKING_URIS "
                           f"({offered}); leave it unset for the SQLite store under logging.dir")


def completions_table(rows: list[CompletionRow]) -> tuple[list[str], list[list]]:
    """Columns and cells of completions rows: :data:`COMPLETION_COLUMNS`, then each column reward functions
    logged (the union over the rows, sorted; None where a row has none; one named like an own column is
    ``logged.<name>``)."""
    logged = sorted({c for r in rows for c in r.logged})
    columns = [*COMPLETION_COLUMNS, *(f"logged.{c}" if c in COMPLETION_COLUMNS else c for c in logged)]
    cells = [[r.step, r.prompt, r.completion, r.reward, r.advantage, *(r.logged.get(c) for c in logged)]
             for r in rows]
    return columns, cells


def markdown_table(rows: list[CompletionRow]) -> str:
    """The rows as a markdown table, ``|`` escaped and newlines as ``<br>`` in cells (TensorBoard's text
    plugin renders markdown)."""
    def cell(v) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")

    columns, cells = completions_table(rows)
    lines = [columns, ["---"] * len(columns), *cells]
    return "\n".join("| " + " | ".join(cell(v) for v in line) + " |" for line in lines)


# -- the trackers ---------------------------------------------------------------------------------


class Tracker:
    """One tracker of one run. Its methods block (library calls): the hub runs them in a thread."""

    name = ""

    def log(self, points: list[MetricPoint]) -> None:
        raise NotImplementedError

    def log_completions(self, rows: list[CompletionRow]) -> None:
        raise NotImplementedError

    def close(self, state: str) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    """Event files under ``<dir>/tensorboard/<run_id>``, written with TensorBoard's own writer; the
    config as the hparams plugin's session start (what ``SummaryWriter.add_hparams`` writes)."""

    name = "tensorboard"

    def __init__(self, root: Path, run_id: str, hparams: dict) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.logdir = root / "tensorboard" / run_id
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.logdir))
        self.writer.add_event(Event(wall_time=time.time(), step=0, summary=self._hparams(hparams)))
        self.writer.flush()

    def _hparams(self, hparams: dict):
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.plugins.hparams.metadata import (
            PLUGIN_DATA_VERSION,
            PLUGIN_NAME,
            SESSION_START_INFO_TAG,
        )
        from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionStartInfo

        ssi = SessionStartInfo()
        for k, v in hparams.items():
            if isinstance(v, bool):  # before int: a bool is an int
                ssi.hparams[k].bool_value = v
            elif isinstance(v, int | float):
                ssi.hparams[k].number_value = v
            else:
                ssi.hparams[k].string_value = str(v)
        content = HParamsPluginData(session_start_info=ssi, version=PLUGIN_DATA_VERSION).SerializeToString()
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=content))
        return self._summary(value=[self._summary.Value(tag=SESSION_START_INFO_TAG, metadata=meta)])

    def log(self, points: list[MetricPoint]) -> None:
        for p in points:
            group = group_of(p.source)
            values = [self._summary.Value(tag=f"{group}/{k}", simple_value=v) for k, v in p.values.items()]
            self.writer.add_event(self._event(wall_time=p.t, step=p.step, summary=self._summary(value=values)))
        self.writer.flush()

    def log_completions(self, rows: list[CompletionRow]) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        for step, group in groupby(rows, key=lambda r: r.step):  # the learner appends them step by step
            at_step = list(group)
            wall_time = int(at_step[0].id.split("-")[0]) / 1000  # the stream id's milliseconds
            summary = text_pb("completions", markdown_table(at_step))
            self.writer.add_event(self._event(wall_time=wall_time, step=step, summary=summary))
        self.writer.flush()

    def close(self, state: str) -> None:
        self.writer.close()


class WandB(Tracker):
    """A W&B run with the tandem run's id (``wandb.init(id=run_id, resume="allow")``), its files
    under ``<dir>/wandb``; W&B's system metrics are off (they would describe the control plane)."""

    name = "wandb"

    def __init__(self, root: Path, run_id: str, cfg: LoggingConfig, project: str, config: dict) -> None:
        import wandb

        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, entity=cfg.wandb_entity, name=run_id, id=run_id, dir=str(root), mode=cfg.wandb_mode,
            config=config, resume="allow", reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.groups: set[str] = set()

    def _define(self, group: str) -> None:
        if group not in self.groups:  # each group against its own step: they do not rise together
            self.run.define_metric(f"{group}/step")
            self.run.define_metric(f"{group}/*", step_metric=f"{group}/step")
            if group == "train":  # the learner's completions table, as TRL names it
                self.run.define_metric("completions", step_metric="train/step")
            self.groups.add(group)

    def log(self, points: list[MetricPoint]) -> None:
        for p in points:
            group = group_of(p.source)
            self._define(group)
            self.run.log({f"{group}/step": p.step, **{f"{group}/{k}": v for k, v in p.values.items()}})

    def log_completions(self, rows: list[CompletionRow]) -> None:
        import wandb

        self._define("train")
        for step, at_step in groupby(rows, key=lambda r: r.step):
            columns, cells = completions_table(list(at_step))  # a logged column may hold numbers and text
            self.run.log({"train/step": step,
                          "completions": wandb.Table(columns=columns, data=cells, allow_mixed_types=True)})

    def close(self, state: str) -> None:
        self.run.finish(exit_code=1 if state == "failed" else 0)


class MLflow(Tracker):
    """An MLflow run tagged ``tandem.run_id`` in experiment ``project`` (found again on a restart)."""

    name = "mlflow"
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}

    def __init__(self, root: Path, run_id: str, cfg: LoggingConfig, project: str, params: dict) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        root.mkdir(parents=True, exist_ok=True)
        default = cfg.mlflow_tracking_uri is None
        self.client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}" if default
                                   else cfg.mlflow_tracking_uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            project, artifact_location=(root / "mlflow-artifacts").as_uri() if default else None)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`tandem.run_id` = '{run_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(exp_id, run_name=run_id, tags={"tandem.run_id": run_id}).info.run_id
        items = [Param(k, str(v)[:_MLFLOW_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), _MLFLOW_PARAMS):
            self.client.log_batch(self.run_id, params=items[i:i + _MLFLOW_PARAMS])

    def log(self, points: list[MetricPoint]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(f"{group_of(p.source)}/{k}", v, int(p.t * 1000), p.step)
                   for p in points for k, v in p.values.items()]
        for i in range(0, len(metrics), _MLFLOW_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_METRICS])

    def log_completions(self, rows: list[CompletionRow]) -> None:
        columns, cells = completions_table(rows)  # MLflow appends them to the artifact's rows
        self.client.log_table(self.run_id, data={c: [row[i] for row in cells] for i, c in enumerate(columns)},
                              artifact_file="completions.json")

    def close(self, state: str) -> None:
        if state in self.STATUS:  # a run still going stays RUNNING (the control plane restarts)
            self.client.set_terminated(self.run_id, self.STATUS[state])


def open_trackers(config: RunConfig, run_id: str, root: Path, mlflow_uris: list[str]) -> list[Tracker]:
    """Start each tracker ``config.logging`` names (blocking). Raises :class:`TrackerError` naming the
    one that could not start, after closing those already started, or an MLflow URI that is not one of
    ``mlflow_uris`` (:func:`check_mlflow_uri`)."""
    check_mlflow_uri(config, mlflow_uris)
    preflight(config)
    cfg = config.logging
    raw = config.model_dump(mode="json")
    project = cfg.project or config.name
    opened: list[Tracker] = []
    for name in cfg.trackers:
        try:
            if name == "tensorboard":
                opened.append(TensorBoard(root, run_id, flatten(raw)))
            elif name == "wandb":
                opened.append(WandB(root, run_id, cfg, project, raw))
            else:
                opened.append(MLflow(root, run_id, cfg, project, flatten(raw)))
        except Exception as e:  # any failure of the library to start: named, and the run is not created
            for t in opened:
                _close_quietly(t, "failed")
            raise TrackerError(f"logging.trackers: {name} cannot start: {type(e).__name__}: {e}") from e
    return opened


def _close_quietly(tracker: Tracker, state: str) -> str | None:
    """Close ``tracker``; the error's text if that failed (reported by the caller)."""
    try:
        tracker.close(state)
    except Exception as e:  # a tracker that fails to close is reported, never fatal to the hub
        return f"{type(e).__name__}: {e}"
    return None


# -- the follower ---------------------------------------------------------------------------------


@dataclass
class Following:
    """One run's open trackers and how far its metrics stream and its completions stream have been logged."""

    run_id: str
    config: RunConfig
    root: Path
    trackers: list[Tracker]
    cursor: str | None = None
    completions_cursor: str | None = None
    last_point: float = field(default_factory=time.monotonic)

    @property
    def cursor_file(self) -> Path:
        return self.root / f"{self.run_id}.cursor"

    @property
    def completions_cursor_file(self) -> Path:
        return self.root / f"{self.run_id}.completions.cursor"

    def load_cursors(self) -> None:
        """The cursors a control plane that followed this run before left (None: from the start)."""
        files = (self.cursor_file, self.completions_cursor_file)
        self.cursor, self.completions_cursor = (f.read_text().strip() or None if f.exists() else None for f in files)

    def save_cursors(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for f, cursor in ((self.cursor_file, self.cursor), (self.completions_cursor_file, self.completions_cursor)):
            if cursor is not None:
                f.write_text(cursor + "\n")


class TrackerHub:
    """The control plane's follower of the active run's metrics and completions into its trackers (module docstring)."""

    def __init__(self, redis, run_dir: Path, *, mlflow_uris: list[str] = (), poll_s: float = 1.0) -> None:
        self.redis = redis
        self.runs = RunStore(redis)
        self.run_dir = Path(run_dir)
        self.mlflow_uris = list(mlflow_uris)
        self.poll_s = poll_s
        self.current: Following | None = None
        self._opened: dict[str, Following] = {}  # by POST /v1/runs, not yet picked up by the loop
        self._skipped: set[str] = set()  # runs without trackers, or whose trackers could not reopen

    async def open(self, run_id: str, config: RunConfig) -> None:
        """Start the trackers of a run about to be created; ``ServiceError`` 422 if one cannot start
        (409 first if another run is active: no tracker run is started for a run that is refused)."""
        if not config.logging.trackers:
            return
        active = await self.runs.active()
        if active is not None:
            raise ServiceError(409, f"run {active.run_id} is {active.state}: one run at a time; stop it first")
        try:
            root = tracker_dir(config, self.run_dir, run_id)
            trackers = await asyncio.to_thread(open_trackers, config, run_id, root, self.mlflow_uris)
        except TrackerError as e:
            raise ServiceError(422, str(e)) from None
        self._opened[run_id] = Following(run_id, config, root, trackers)

    async def discard(self, run_id: str) -> None:
        """The run was not created after all: close the trackers :meth:`open` started for it."""
        following = self._opened.pop(run_id, None)
        if following is not None:
            await asyncio.to_thread(lambda: [_close_quietly(t, "failed") for t in following.trackers])

    def start(self) -> TrackerHub:
        """Follow runs in a task of the running event loop until :meth:`stop`."""
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self.run(), name="trackers")
        return self

    async def stop(self) -> None:
        """Let the poll in progress finish (at most :data:`STOP_WAIT_S`), then log what is left of the
        current run and close its trackers."""
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), STOP_WAIT_S)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.aclose()

    async def run(self) -> None:
        """Follow runs until :meth:`stop`."""
        while not self._stopping.is_set():
            try:
                await self.tick()
            except Exception:  # Redis unavailable a moment: the next tick tries again
                log.exception("trackers: following the run's metrics failed; retrying")
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.poll_s)

    async def tick(self) -> None:
        """One poll: pick up the newest run (the active one, if any; or one that ended while no control
        plane followed it), log the current run's new points, close its trackers when it is done."""
        newest = await self.runs.list(1)
        if newest and newest[0].run_id not in self._skipped and (
                self.current is None or self.current.run_id != newest[0].run_id):
            await self._close_current()
            self.current = await self._take(newest[0].run_id, newest[0].config)
        following = self.current
        if following is None:
            return
        await self._pump(following)
        if not following.trackers:  # every one failed (each reported): none is reopened for this run
            self._skipped.add(following.run_id)
            self.current = None
            return
        state = (await self.runs.get(following.run_id)).state
        if state in TERMINAL_STATES and time.monotonic() - following.last_point >= \
                following.config.logging.close_after_s:
            await self._close_current(state)

    async def aclose(self) -> None:
        """Log what is left of the current run and close its trackers (the control plane stops)."""
        if self.current is not None:
            try:
                await self._pump(self.current)
            finally:
                state = (await self.runs.get(self.current.run_id)).state
                await self._close_current(state if state in TERMINAL_STATES else "running")
        for run_id in list(self._opened):
            await self.discard(run_id)
        wandb = sys.modules.get("wandb")
        if wandb is not None:  # W&B was used here: end its service process
            await asyncio.to_thread(wandb.teardown)

    async def _take(self, run_id: str, raw_config: dict) -> Following | None:
        """The trackers of the newest run: those ``POST /v1/runs`` opened, else (the control plane
        restarted during the run, or after it ended but before its trackers were closed) opened
        again now; None if it has none, or they were closed after it ended."""
        if run_id in self._opened:
            return self._opened.pop(run_id)
        config = parse_run_config(raw_config, f"run {run_id}")
        if not config.logging.trackers:
            self._skipped.add(run_id)
            return None
        try:  # the settings may have changed since the run was created: checked again
            root = tracker_dir(config, self.run_dir, run_id)
            if (root / f"{run_id}.closed").exists():
                self._skipped.add(run_id)
                return None
            trackers = await asyncio.to_thread(open_trackers, config, run_id, root, self.mlflow_uris)
        except TrackerError as e:
            self._skipped.add(run_id)
            await self._report(run_id, "all trackers", str(e), "the run goes on without its trackers")
            return None
        following = Following(run_id, config, root, trackers)
        following.load_cursors()
        log.info("trackers of run %s reopened (%s), from metric point %s", run_id,
                 ", ".join(t.name for t in trackers), following.cursor or "the start")
        return following

    async def _pump(self, following: Following) -> None:
        """Log every point after the cursor, then every completions row after its cursor, in order, to each
        tracker; move the cursors."""
        keys = Keys(following.run_id)
        metrics, completions = MetricsLog(self.redis, keys), CompletionsLog(self.redis, keys)
        while following.trackers:
            points = await metrics.read(following.cursor, READ_BATCH)  # values are finite (MetricsLog checks)
            if not points:
                break
            await self._hand(following, "log", points)
            following.cursor = points[-1].id
            following.last_point = time.monotonic()
            following.save_cursors()
        while following.trackers:
            rows = await completions.read(following.completions_cursor, READ_BATCH)
            if not rows:
                return
            await self._hand(following, "log_completions", rows)
            following.completions_cursor = rows[-1].id
            following.last_point = time.monotonic()
            following.save_cursors()

    async def _hand(self, following: Following, method: str, batch: list) -> None:
        """Call each tracker's ``method`` (``log``, ``log_completions``) with ``batch``; a tracker whose call
        raises is reported and dropped."""
        for tracker in list(following.trackers):
            try:
                await asyncio.to_thread(getattr(tracker, method), batch)
            except Exception as e:  # reported and dropped; training and the other trackers go on
                following.trackers.remove(tracker)
                await self._report(following.run_id, tracker.name, f"{type(e).__name__}: {e}",
                                   "this tracker is dropped for the rest of the run; training goes on")
                await asyncio.to_thread(_close_quietly, tracker, "failed")

    async def _close_current(self, state: str = "running") -> None:
        following, self.current = self.current, None
        if following is None:
            return
        for tracker in following.trackers:
            error = await asyncio.to_thread(_close_quietly, tracker, state)
            if error:
                await self._report(following.run_id, tracker.name, error, "its last points may be missing")
        if state in TERMINAL_STATES:  # done for good: a restarted control plane leaves it closed
            self._skipped.add(following.run_id)
            following.root.mkdir(parents=True, exist_ok=True)
            (following.root / f"{following.run_id}.closed").write_text(state + "\n")
        log.info("trackers of run %s closed (%s)", following.run_id, state)

    async def _report(self, run_id: str, tracker: str, error: str, action: str) -> None:
        """A log line and an incident of the run (``tandem status``, the dashboard)."""
        log.error("trackers of run %s: %s failed: %s; %s", run_id, tracker, error, action)
        inc = incident(f"the {tracker} tracker of run {run_id}", error, waited_s=0.0, limit_s=0.0,
                       field="logging.trackers", action=action, source=SOURCE)
        try:
            await IncidentLog(self.redis, Keys(run_id), source=SOURCE).append(inc)
        except Exception as e:  # the log line above already says it
            log.error("could not record the incident: %r", e)
