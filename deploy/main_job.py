"""``tandem run CONFIG``: the main job, end to end on one machine.

1. Bootstrap the example model if the config asks for it and it is missing.
2. Start the local stack (:class:`deploy.stack.Stack`): embedded
   Redis, reward server, control plane, rollout server, learner.
3. Upload the training and held-out prompt sets and start the run on the
   control plane; follow it with a progress bar (step, reward, lag, the
   newest held-out accuracy; plain lines when stdout is not a terminal:
   ``deploy.progress``) until the learner finishes it. The rollout
   server evaluates version 0 at the start of the run, while the learner
   starts up, and every ``eval.every`` versions (:mod:`services.evaluate`).
4. Read the final version's held-out result: with ``eval.after`` the learner
   asks a rollout server to evaluate it, as for any run, and the run finishes
   once it is recorded (``learner.service.evaluate_final``).
5. Write ``summary.json`` and the report plots, stop the stack, move its
   directory to ``runs/<run_id>/`` and print that path as the last line.
   ``accuracy_before`` / ``accuracy_after`` are the held-out accuracy of
   version 0 and of the final version (mean@n with ``eval.samples = n > 1``,
   whose pass@k are ``pass_at_before`` / ``pass_at_after`` and each entry's
   ``pass_at`` in ``evals``); ``held_out_reward_before`` / ``held_out_reward_after`` are their mean
   reward (a reward model's held-out score). ``incidents`` lists every watchdog and stall
   incident of the run; ``timeline.jsonl`` beside it holds every service's
   spans (``tandem trace runs/<run_id>``), ``completions.jsonl`` the run's completions table
   (``logging.completions``: trained samples with what reward functions logged for them).
6. Audit the run's ledger (:mod:`deploy.audit`, as ``tandem audit``) and
   put the verdict in ``summary.json`` as ``audit``.

Before any of it, :func:`check_files` reads the run's prompt sets as the control plane will (a
minute later, once the stack is up): a mistake in the run's files (a path that does not exist, lines
that do not fit the config, no answers for the example's cold start) is a
:class:`~services.config.ConfigError` naming the file and what to change, which ``tandem run``
prints as one line (exit 2) before anything starts.

Exit code 0 only when every step succeeded and the audit passed.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from rich.console import Console

from broker import Keys, WeightRegistry, connect
from control_plane.trackers import TrackerError, preflight
from deploy.audit import audit_file
from deploy.client import http_error
from deploy.datasets import FILE_KINDS
from deploy.progress import console as cli_console
from deploy.progress import progress_bar
from deploy.report import (
    cpu_text,
    eval_text,
    pass_at,
    reward_not_accuracy,
    write_plots,
    write_summary,
)
from deploy.settings import StackSettings
from deploy.stack import Stack
from services import timeline, wire
from services.clients import ControlClient
from services.config import ConfigError, RunConfig
from services.evaluate import EvalLog, load_eval_set
from services.prompt_forms import chat_template_in, prompt_forms
from services.prompt_lines import MAX_ERRORS, LineError, LineParser, format_error, line_specs
from services.run_states import TERMINAL_STATES

COMPLETIONS_FILE = "completions.jsonl"
"""The run's completions table (``logging.completions`` rows per step, ``log_extra`` columns), in the run's folder."""


class JobError(RuntimeError):
    """The main job could not complete; the message says which step failed."""


def check_files(config_path: Path, config: RunConfig) -> None:
    """Raise :class:`ConfigError` for what the control plane would refuse in the run's prompt sets once
    the stack is up: a file that does not exist, lines that do not fit the config's ``reward`` and
    ``prompt`` sections (``services.prompt_lines``, ``services.prompt_forms``, as ``POST /v1/runs``
    reads them). Only the reward server can say whether a python reward function is allowed."""
    if config.data.eval is None:
        raise ConfigError(f"{config_path}: data.eval: missing; tandem run reports held-out accuracy before and "
                          "after training: name a held-out prompt set")
    for field, path in (("data.train", config.data.train), ("data.eval", config.data.eval)):
        if not path.exists():
            raise ConfigError(f"{config_path}: {field}: {path} does not exist; correct the path (a relative one "
                              "is read from the config's folder)")
        if path.is_dir() or FILE_KINDS.get(path.suffix.lower(), "json") != "json":
            raise ConfigError(f"{config_path}: {field}: {path} is a dataset, not the JSON lines tandem run reads; "
                              f"import it (tandem prompts import {path} --map prompt=COLUMN,...) and train on it with "
                              "tandem up and tandem submit --prompt-set ID (docs/tutorial.md)")
    chat = chat_template_in(config.model.path)
    try:
        parser = LineParser(config.reward.type)
        parser.feed(config.data.train.read_bytes())
        lines = parser.finish()
        line_specs(lines, config)
        prompt_forms(lines, config, chat)
    except LineError as e:
        raise ConfigError(_line_problems(config.data.train, e, config_path)) from None
    try:
        load_eval_set(config.data.eval, config, None)
    except LineError as e:
        raise ConfigError(_line_problems(config.data.eval, e, config_path)) from None


def _line_problems(path: Path, e: LineError, config_path: Path) -> str:
    """The first problem of ``path``'s lines, and how many other lines have one (at least: a parser stops
    at ``MAX_ERRORS``)."""
    others = len({problem["line"] for problem in e.errors}) - 1
    more = (f" (and {'at least ' if len(e.errors) >= MAX_ERRORS else ''}{others} more line{'s' if others > 1 else ''})"
            if others else "")
    return (f"{path}: {format_error(e.errors[0])}{more}; change the file, or the [reward] and [prompt] sections of "
            f"{config_path} it is read with")


@contextmanager
def _refused_as(path: Path, files: dict[str, Path] | None = None) -> Iterator[None]:
    """The control plane's 422 (the user's input: ``control_plane.app``) inside, as a :class:`ConfigError`
    naming ``path``, with the ids of the prompt sets uploaded from ``files`` put back as their files."""
    try:
        yield
    except httpx.HTTPStatusError as e:
        if e.response.status_code != 422:
            raise
        message = http_error(e)
        for set_id, file in (files or {}).items():
            message = message.replace(f"prompt set {set_id}", str(file))
        raise ConfigError(f"{path}: {message}") from None


def ensure_model(config_path: Path, config: RunConfig, console: Console) -> None:
    if config.model.bootstrap is None:
        if (config.model.path / "config.json").exists():
            return
        raise ConfigError(f"{config_path}: model.path: {config.model.path} holds no model (no config.json); point "
                          "it at a Hugging Face model folder, or set model.bootstrap to build an example model there")
    example = importlib.import_module(f"examples.{config.model.bootstrap}.bootstrap")
    if example.is_built(config.model.path, config.data.train):
        return
    example.check_data(config.data.train)  # before the cold start is announced

    console.print(f"bootstrapping the example model into {config.model.path} (a one-time cold start)")
    with progress_bar("bootstrap SFT", total=example.SFT_STEPS) as update:
        example.bootstrap(config.model.path, config.data.train,
                          progress=lambda s, n, loss: update(s, f"loss {loss:.3f}"))


async def _final(stack: Stack, run_id: str) -> tuple[int, wire.EvalPoint | None]:
    """The run's final version and its held-out result (recorded before the run finished: the learner asks
    a rollout server for it with ``eval.after``, ``learner.service.evaluate_final``), or None."""
    redis = connect(stack.redis_url)
    try:
        latest = await WeightRegistry(redis, Keys(run_id)).latest()
        if latest is None:
            raise JobError("the learner finished without publishing a weight version")
        return latest.version, (await EvalLog(redis, Keys(run_id)).points()).get(latest.version)
    finally:
        await redis.aclose()


def eval_fields(points: list[wire.MetricPoint], after: wire.EvalPoint | None, samples: int) -> dict:
    """summary.json's held-out fields, from the run's ``"eval"`` metric points (one per version) and the
    final version's result: accuracy and mean reward before (version 0) and after, every version's point, and
    with ``samples`` > 1 (accuracy is then mean@samples) pass@k before and after."""
    evals = {p.step: (p.values["accuracy"], pass_at(p.values)) for p in points if p.source == "eval"}
    rewards = {p.step: p.values.get("held_out_reward") for p in points if p.source == "eval"}
    return {
        "accuracy_before": evals[0][0] if 0 in evals else None,
        "accuracy_after": after.accuracy if after is not None else None,
        "held_out_reward_before": rewards.get(0),
        "held_out_reward_after": after.reward_mean if after is not None else None,
        "eval_prompts": after.count if after is not None else None,
        "eval_samples": samples,
        "pass_at_before": (evals[0][1] or None) if 0 in evals else None,
        "pass_at_after": (after.pass_at or None) if after is not None else None,
        "evals": [{"version": v, "accuracy": acc, "held_out_reward": rewards[v]} | ({"pass_at": passes} if passes else {})
                  for v, (acc, passes) in sorted(evals.items())],
    }


def _progress_note(st: wire.RunStatus) -> str:
    lag = st.staleness.max_observed_lag
    note = (f"reward {st.reward_mean if st.reward_mean is not None else float('nan'):.2f}"
            f"  lag<={lag if lag is not None else '-'}  dropped {wire.dropped_text(st.dropped())}")
    if st.eval is not None:
        note += f"  eval {eval_text(st.eval, every_k=False)} (v{st.eval.version})"
    return note


async def _follow(stack: Stack, config: RunConfig, run_id: str) -> wire.RunStatus:
    async with ControlClient(stack.url("control"), stack.token) as control:
        with progress_bar("training", total=config.learner.steps) as update:
            evaluated = None  # the newest evaluated version shown: a new one is worth a line in a log
            while True:
                stack.check()  # restarts a crashed service (the control plane too: then try again)
                try:
                    st = await control.run_status(run_id)
                except httpx.TransportError:
                    await asyncio.sleep(1.0)
                    continue
                newest = st.eval.version if st.eval is not None else None
                update(st.run.step, _progress_note(st), mark=newest != evaluated)
                evaluated = newest
                if st.run.state in TERMINAL_STATES:
                    return st
                await asyncio.sleep(1.0)


def _stack_lines_only(console: Console):
    """Show the supervisor's own lines; the services' logs go to <run dir>/logs/ only."""
    def echo(line: str) -> None:
        if line.startswith("[stack]"):
            console.print(line, markup=False, highlight=False)

    return echo


class _Ended(Exception):
    """The run ended other than finished (``run_job``)."""


def run_job(config_path: Path, config: RunConfig, settings: StackSettings, runs_root: Path = Path("runs")) -> Path:
    """Run the main job; return the run directory. Raises :class:`ConfigError` for a mistake in the run's
    files, :class:`JobError` on another failure."""
    console = cli_console()
    started = time.monotonic()
    try:
        preflight(config)  # the control plane would refuse the run: say so before anything starts
    except TrackerError as e:
        raise JobError(str(e)) from None
    check_files(config_path, config)
    ensure_model(config_path, config, console)
    work = runs_root.resolve() / f".stack-{os.getpid()}"
    stack = Stack(work, settings, config=config_path, echo=_stack_lines_only(console))
    run_id, failed = None, None
    try:
        with console.status("starting the stack (redis, reward, control, rollout, learner)"):
            stack.start()

        async def submit() -> wire.RunCreated:
            async with ControlClient(stack.url("control"), stack.token) as control:
                with _refused_as(config.data.train):
                    info = await control.upload_prompt_set(config.data.train.read_bytes(), config.reward.type)
                with _refused_as(config.data.eval):
                    held_out = await control.upload_prompt_set(config.data.eval.read_bytes(), config.reward.type)
                # a 422 here is what only the services can check: the model as they see it, the reward
                # functions that lines take from the config's reward.type
                with _refused_as(config_path, {info.id: config.data.train, held_out.id: config.data.eval}):
                    return await control.create_run(info.id, config.model_dump(mode="json"), held_out.id)

        created = asyncio.run(submit())
        run_id = created.run_id
        console.print(f"run {run_id}: {created.groups} prompt groups queued")
        final = asyncio.run(_follow(stack, config, run_id))
        if final.run.state != "finished":
            stack.cpu.record(run_id, force=True)
            failed = asyncio.run(_status(stack, run_id)), asyncio.run(_timeline(stack, run_id))[1]
            raise _Ended
        version, after = asyncio.run(_final(stack, run_id))
        after = after if config.eval.after else None
        stack.cpu.record(run_id, force=True)  # the account up to the run's end, for the status
        status = asyncio.run(_status(stack, run_id))
        spans, incidents = asyncio.run(_timeline(stack, run_id))
        points = asyncio.run(_metrics(stack, run_id))
        completions = asyncio.run(_completions(stack, run_id))
        evals = eval_fields(points, after, config.eval.samples)["evals"]
        if config.eval.before and not any(e["version"] == 0 for e in evals):
            raise JobError("no held-out evaluation of version 0 was recorded (see the rollout server's log)")
        if config.eval.after and after is None:
            raise JobError(f"no held-out evaluation of the final version {version} was recorded (see the rollout "
                           "server's and the learner's logs)")
        n = config.eval.samples
        if evals:  # none with [eval] off (examples/tool_arith: held-out evaluation is single-turn)
            console.print(f"held-out {'mean@n / pass@n' if n > 1 else 'accuracy'} by policy version: " + ", ".join(
                f"v{e['version']} {e['accuracy']:.1%}" + (f" / {e['pass_at'][n]:.1%}" if n in e.get("pass_at", {})
                                                           else "")
                + (f" (reward {e['held_out_reward']:.3g})" if reward_not_accuracy(e["held_out_reward"], e["accuracy"]) else "")
                for e in evals))
        episodes = _run_means(points, EPISODE_MEANS)
        if episodes["episode_turns_mean"] is not None:
            console.print("episodes (run means): " + ", ".join(
                f"{name} {value:.2f}" for name, value in episodes.items() if value is not None))
        if after is not None:
            console.print(f"held-out accuracy after:  {eval_text(after)} (policy version {version}, "
                          f"{after.count} prompts)")
        if status.cpu is not None:
            console.print(f"CPU-seconds per trained sample: {cpu_text(status.cpu)}")
    except _Ended:
        pass  # the stack stops, then summary.json says why and the job fails
    finally:
        stack.stop()
        if run_id is not None and work.exists():
            target = runs_root.resolve() / run_id
            if target.exists():
                shutil.rmtree(target)
            work.rename(target)
    run_dir = runs_root.resolve() / run_id
    if failed is not None:
        status, incidents = failed
        write_summary(run_dir / "summary.json", {
            "run_id": run_id, "config": str(config_path), "state": status.run.state, "error": status.run.error,
            "steps": status.run.step, "wall_s": round(time.monotonic() - started, 1), "dropped": status.dropped(),
            "counters": status.counters,
            "incidents": [i.model_dump(mode="json", exclude={"stack"}) for i in incidents]})
        raise JobError(f"run {run_id} ended {status.run.state}: {status.run.error} (see {run_dir / 'summary.json'} "
                       f"and the services' logs in {run_dir / 'logs'})")
    write_plots(points, run_dir / "report")
    (run_dir / COMPLETIONS_FILE).write_text("".join(row.model_dump_json(exclude={"id"}) + "\n" for row in completions))
    timeline.write_file(run_dir / timeline.TIMELINE_FILE, spans)  # tandem trace reads it
    st = status.staleness
    summary = {
        "run_id": run_id,
        "config": str(config_path),
        **eval_fields(points, after, config.eval.samples),
        "steps": status.run.step,
        "final_version": version,
        "samples": status.counters.get("produced", 0) * config.sampling.group_size,
        "groups_trained": status.counters.get("accepted", 0),
        "wall_s": round(time.monotonic() - started, 1),
        "max_staleness": st.max_staleness,
        "max_observed_lag": st.max_observed_lag,
        "stale_dropped": st.stale_dropped,
        "dropped": status.dropped(),
        "counters": status.counters,
        "throughput": _run_means(points, wire.Throughput.model_fields),
        "episodes": _run_means(points, EPISODE_MEANS),
        "incidents": [i.model_dump(mode="json", exclude={"stack"}) for i in incidents],
        "cpu": status.cpu.model_dump(mode="json") if status.cpu is not None else None,
    }
    try:
        verdict = audit_file(run_dir).as_dict()
    except FileNotFoundError as e:
        verdict = {"ok": False, "violations": 1, "first_violations": [str(e)]}
    summary["audit"] = verdict
    write_summary(run_dir / "summary.json", summary)
    if not verdict["ok"]:
        raise JobError(f"the audit of {run_dir} failed ({verdict['violations']} violations; first: "
                       f"{verdict['first_violations'][0]}); see summary.json or `tandem audit {run_dir}`")
    console.print(f"audit: ok ({verdict['groups']['trained']} groups trained once each, "
                  f"{verdict['groups']['dropped']} dropped with a reason, none lost)")
    return run_dir


EPISODE_MEANS = ("episode_turns_mean", "tool_calls_mean", "tool_success_frac")
"""The learner's per-step episode figures (``learner.trainer.episode_means``): summary.json's ``episodes``
holds their means over the run (None for a run without episodes; docs/episodes.md, section 7)."""


def _run_means(points: list[wire.MetricPoint], names) -> dict[str, float | None]:
    """The mean of each of ``names`` over the run's metric points (the status holds only the last
    sample, taken after the rollout servers went idle)."""
    out = {}
    for name in names:
        xs = [p.values[name] for p in points if name in p.values]
        out[name] = sum(xs) / len(xs) if xs else None
    return out


async def _timeline(stack: Stack, run_id: str) -> tuple[list[timeline.Span], list[wire.Incident]]:
    """The run's spans and every incident (watchdogs, stalls), oldest first, from the stack's Redis."""
    from deploy.trace import from_redis

    redis = connect(stack.redis_url)
    try:
        return await from_redis(redis, run_id)
    finally:
        await redis.aclose()


async def _status(stack: Stack, run_id: str) -> wire.RunStatus:
    async with ControlClient(stack.url("control"), stack.token) as control:
        return await control.run_status(run_id)


async def _metrics(stack: Stack, run_id: str) -> list[wire.MetricPoint]:
    async with ControlClient(stack.url("control"), stack.token) as control:
        return await control.metrics(run_id)


async def _completions(stack: Stack, run_id: str) -> list[wire.CompletionRow]:
    async with ControlClient(stack.url("control"), stack.token) as control:
        return await control.completions(run_id)
