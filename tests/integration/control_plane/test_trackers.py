"""Experiment trackers (control_plane/trackers.py) in the real control plane, on real Redis, through
the trackers' own libraries, read back with their own readers: TensorBoard's EventAccumulator,
W&B's offline run file (WANDB_MODE offline; the transaction log read record by record with W&B's
protobuf types) and MLflow's client on its local store.

The metric points are appended with the writers the learner, the rollout servers and the evaluator
use (``MetricsLog.append``, ``EvalLog.record``), to the stream the trackers follow; the completions
table's rows with the learner's (``CompletionsLog.append``).
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from pathlib import Path

import pytest

from broker import Keys
from services.evaluate import EvalLog, EvalResult
from services.runs import CompletionsLog, MetricsLog, RunStore
from tests.fixtures.control import ARITH_LINES, TOKEN, control_settings, run_config

pytestmark = pytest.mark.slow
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


class ControlPlane:
    """The control plane app with its lifespan run (``async with``), an ASGI client; restartable."""

    def __init__(self, url: str, run_dir: Path, **settings) -> None:
        self.url, self.run_dir, self.settings = url, run_dir, settings

    async def __aenter__(self):
        import httpx

        from control_plane import build_app

        self.app = build_app(control_settings(self.url, self.run_dir, **self.settings))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://control")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(*exc)

    @property
    def hub(self):
        return self.app.state.trackers

    async def create(self, logging: dict) -> tuple[int, dict]:
        body = "\n".join(json.dumps(x) for x in ARITH_LINES).encode()
        r = await self.client.post("/v1/prompt-sets", content=body,
                                   headers={**HEADERS, "Content-Type": "application/x-ndjson"})
        assert r.status_code == 201, r.text
        r = await self.client.post("/v1/runs", headers=HEADERS, json={
            "prompt_set_id": r.json()["id"], "config": run_config(logging=logging, learner={"lr": 3e-4})})
        return r.status_code, r.json()

    async def logged_through(self, point_id: str, timeout_s: float = 60) -> None:
        """Wait until the hub has logged the run's stream up to ``point_id``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = self.hub.current
            if current is not None and current.cursor is not None and _order(current.cursor) >= _order(point_id):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the trackers did not log up to {point_id}")

    async def closed(self, run_id: str, timeout_s: float = 60) -> None:
        """Wait until the hub has closed the trackers of ``run_id`` for good (the run ended)."""
        marker = self.run_dir / run_id / "trackers" / f"{run_id}.closed"
        deadline = time.monotonic() + timeout_s
        while not marker.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert marker.exists(), "the run's trackers were not closed"
        assert self.hub.current is None


def _order(stream_id: str) -> tuple[int, ...]:
    return tuple(int(x) for x in stream_id.split("-"))


async def learner_step(metrics: MetricsLog, step: int) -> str:
    """The learner's metric point of ``step`` (the names learner.trainer's _report writes; ``reward_correct``:
    the mean of a python reward function's component named ``correct``)."""
    return await metrics.append("learner", step, reward_mean=0.1 * step, reward_correct=0.05 * step, loss=1.0 / step, kl=0.01 * step,
                                entropy=2.0, clip_fraction=0.05, lag_max=1.0, lag_mean=0.5, stale_dropped=float(step),
                                zero_variance_dropped=2.0 * step, learner_tokens_per_s=1000.0 + step,
                                learner_idle_frac=0.25)


def completion(step: int, advantage: float, **logged) -> dict:
    """A row of the completions table as the learner appends it (``learner.trainer.completion_rows``)."""
    return {"step": step, "version": step - 1, "group_id": f"g{step}", "prompt": f"{step}+2=?",
            "completion": f"so\n{step + 2}", "reward": 1.0, "advantage": advantage, "logged": logged}


# -- readers ----------------------------------------------------------------------------------------


def tensorboard_scalars(logdir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    content = HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
               for k, v in content.session_start_info.hparams.items()}
    return scalars, hparams


def tensorboard_texts(logdir: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]


def wandb_records(run_file: Path):
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log records in 32 KiB blocks (crc32, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    pos, block, partial = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:  # the block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(partial)
            yield record


def wandb_run(root: Path, run_id: str) -> tuple[list[dict], dict, list[int]]:
    """History rows, config and exit codes over every offline run of ``run_id`` (one per opening)."""
    rows, config, exits = [], {}, []
    for f in sorted(root.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            elif kind == "run":
                config |= {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif kind == "exit":
                exits.append(r.exit.exit_code)
    return rows, config, exits


def wandb_tables(root: Path, run_id: str, key: str) -> list[tuple[int, dict]]:
    """``(train/step, table)`` of each table logged under ``key``: the history row holds a reference, one
    item per field (``[key, "_type"]`` = ``"table-file"``, ``[key, "path"]``, ...), the table itself is a JSON
    file in the run's ``files/``."""
    tables = []
    for run_dir in sorted(root.glob(f"wandb/offline-run-*-{run_id}")):
        for r in wandb_records(run_dir / f"run-{run_id}.wandb"):
            if r.WhichOneof("record_type") != "history":
                continue
            row = {tuple(i.nested_key) or (i.key,): json.loads(i.value_json) for i in r.history.item}
            if (key, "path") in row:
                assert row[key, "_type"] == "table-file", row
                tables.append((row["train/step",], json.loads((run_dir / "files" / row[key, "path"]).read_text())))
    return tables


def series(rows: list[dict], group: str, name: str) -> list[tuple[int, float]]:
    key = f"{group}/{name}"
    return [(row[f"{group}/step"], row[key]) for row in rows if key in row]


# -- tests ------------------------------------------------------------------------------------------


async def test_trackers_log_the_config_every_metric_point_and_the_completions_table_across_a_restart(
        control_db_url, control_redis, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logging = {"trackers": ["tensorboard", "wandb", "mlflow"], "close_after_s": 0, "project": "tracked"}
    async with ControlPlane(control_db_url, tmp_path) as control:
        status, body = await control.create(logging)
        assert status == 201, body
        run_id = body["run_id"]
        metrics, evals = MetricsLog(control_redis, Keys(run_id)), EvalLog(control_redis, Keys(run_id))
        completions = CompletionsLog(control_redis, Keys(run_id))
        await RunStore(control_redis).set_state(run_id, "running")
        await evals.record(0, EvalResult(0.25, 0.25, 8, frozenset({0}), 0), "rollout")
        for step in (1, 2, 3):
            await learner_step(metrics, step)
        await completions.append([completion(1, 0.5, overlong_penalty=-0.5, note="a|b"), completion(1, -0.5),
                                  completion(2, 0.0, overlong_penalty=0.0)])
        await metrics.append("rollout:rollout", 2, rollout_tokens_per_s=500.0, rollout_idle_frac=0.1)
        await evals.record(2, EvalResult(0.5, 0.5, 8, frozenset({2}), 0), "rollout")
        last = (await metrics.read())[-1].id
        await control.logged_through(last)
    # the control plane stopped mid-run (its trackers closed); a new one picks the run up where it was
    async with ControlPlane(control_db_url, tmp_path) as control:
        for step in (4, 5):
            await learner_step(metrics, step)
        await completions.append([completion(3, 0.0), completion(5, 1.0, overlong_penalty=-1.0)])
        await evals.record(4, EvalResult(0.75, 0.75, 8, frozenset({4}), 0), "tandem-run")
        await RunStore(control_redis).set_state(run_id, "finished")
        await control.closed(run_id)  # the run ended, close_after_s = 0

    root = tmp_path / run_id / "trackers"  # the default: under the control plane's run directory
    # TensorBoard: every point once, at its step, under its group; the config as hparams
    scalars, hparams = tensorboard_scalars(root / "tensorboard" / run_id)
    assert scalars["train/loss"] == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3, 4, 5)]
    for name in ("reward_mean", "reward_correct", "kl", "entropy", "clip_fraction", "lag_max", "stale_dropped", "zero_variance_dropped",
                 "learner_tokens_per_s", "learner_idle_frac"):
        assert [s for s, _ in scalars[f"train/{name}"]] == [1, 2, 3, 4, 5], name
    assert scalars["eval/accuracy"] == [(0, 0.25), (2, 0.5), (4, 0.75)]
    assert scalars["rollout/rollout_tokens_per_s"] == [(2, 500.0)]
    assert hparams["learner.lr"] == pytest.approx(3e-4) and hparams["name"] == "ctl"
    assert hparams["sampling.group_size"] == 4 and hparams["logging.trackers"] == '["tensorboard", "wandb", "mlflow"]'

    # W&B (offline run files): one run id, resumed after the restart; each group against its own step
    rows, config, exits = wandb_run(root, run_id)
    assert series(rows, "train", "loss") == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3, 4, 5)]
    assert series(rows, "eval", "accuracy") == [(0, 0.25), (2, 0.5), (4, 0.75)]
    assert series(rows, "rollout", "rollout_idle_frac") == [(2, 0.1)]
    assert config["learner"]["lr"] == pytest.approx(3e-4) and config["sampling"]["group_size"] == 4
    assert exits == [0, 0]

    # MLflow (its local store under the run directory): one run, found again after the restart
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tracked")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.data.tags["tandem.run_id"] == run_id and run.info.status == "FINISHED"
    assert float(run.data.params["learner.lr"]) == pytest.approx(3e-4)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3, 4, 5)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")) == \
        [(0, 0.25), (2, 0.5), (4, 0.75)]

    # the completions table, each row once across the restart: step, prompt, completion, reward, advantage, then
    # what reward functions logged (the union over the rows, sorted)
    columns = ["step", "prompt", "completion", "reward", "advantage", "note", "overlong_penalty"]
    texts = tensorboard_texts(root / "tensorboard" / run_id, "completions")  # a markdown table per learner step
    assert [s for s, _ in texts] == [1, 2, 3, 5]
    assert texts[0][1].splitlines() == ["| " + " | ".join(columns) + " |", "| --- | --- | --- | --- | --- | --- | --- |",
                                        "| 1 | 1+2=? | so<br>3 | 1 | 0.5 | a\\|b | -0.5 |",
                                        "| 1 | 1+2=? | so<br>3 | 1 | -0.5 |  |  |"]
    assert texts[2][1].splitlines()[0] == "| step | prompt | completion | reward | advantage |"
    tables = wandb_tables(root, run_id, "completions")  # a wandb.Table per learner step, against train/step
    assert [s for s, _ in tables] == [1, 2, 3, 5]
    assert tables[0][1]["columns"] == columns
    assert tables[0][1]["data"] == [[1, "1+2=?", "so\n3", 1.0, 0.5, "a|b", -0.5], [1, "1+2=?", "so\n3", 1.0, -0.5, None, None]]
    assert tables[3][1]["columns"] == ["step", "prompt", "completion", "reward", "advantage", "overlong_penalty"]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "completions.json", str(tmp_path))).read_text())
    assert table["columns"] == columns  # MLflow's log_table: every call's rows appended, orient "split"
    assert [(r[0], r[4], r[5], r[6]) for r in table["data"]] == [
        (1, 0.5, "a|b", -0.5), (1, -0.5, None, None), (2, 0.0, None, 0.0), (3, 0.0, None, None), (5, 1.0, None, -1.0)]


async def test_a_tracker_that_cannot_start_fails_the_creation_and_no_run_exists(
        control_db_url, control_redis, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    file_store = (tmp_path / "mlruns").as_uri()
    async with ControlPlane(control_db_url, tmp_path, mlflow_tracking_uris=[file_store]) as control:
        # a bad setting: MLflow 3 refuses its plain file store; TensorBoard, started first, is closed again
        status, body = await control.create({"trackers": ["tensorboard", "mlflow"],
                                             "mlflow_tracking_uri": file_store})
        assert status == 422 and "logging.trackers: mlflow cannot start" in body["detail"], body
        # a library that is not there (the import system marks the module unavailable)
        monkeypatch.setitem(sys.modules, "wandb", None)
        status, body = await control.create({"trackers": ["wandb"]})
        assert status == 422 and "wandb not installed" in body["detail"], body
        assert (await control.client.get("/v1/runs", headers=HEADERS)).json() == []
        assert not [k async for k in control_redis.scan_iter("*eval_prompts*")]
        assert control.hub._opened == {} and control.hub.current is None


async def test_a_tracker_that_fails_mid_run_is_reported_and_the_others_go_on(control_db_url, control_redis, tmp_path):
    from mlflow.tracking import MlflowClient

    async with ControlPlane(control_db_url, tmp_path) as control:
        status, body = await control.create({"trackers": ["mlflow", "tensorboard"], "close_after_s": 0})
        assert status == 201, body
        run_id = body["run_id"]
        metrics = MetricsLog(control_redis, Keys(run_id))
        await RunStore(control_redis).set_state(run_id, "running")
        await control.logged_through(await learner_step(metrics, 1))
        # someone deletes the MLflow run: its next log fails
        mlflow_run = next(t for t in control.hub.current.trackers if t.name == "mlflow")
        MlflowClient(tracking_uri=f"sqlite:///{tmp_path / run_id / 'trackers' / 'mlflow.db'}").delete_run(
            mlflow_run.run_id)
        await control.logged_through(await learner_step(metrics, 2))
        assert [t.name for t in control.hub.current.trackers] == ["tensorboard"]
        await control.logged_through(await learner_step(metrics, 3))
        st = (await control.client.get(f"/v1/runs/{run_id}", headers=HEADERS)).json()
        [incident] = st["incidents"]
        assert incident["source"] == "control:trackers" and "mlflow tracker" in incident["what"]
        assert "deleted" in incident["on"] and "training goes on" in incident["action"]
        await RunStore(control_redis).set_state(run_id, "finished")
        await control.closed(run_id)
    scalars, _ = tensorboard_scalars(tmp_path / run_id / "trackers" / "tensorboard" / run_id)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
