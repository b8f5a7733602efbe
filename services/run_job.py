"""``tandem run CONFIG``: the main job, end to end on one machine.

1. Bootstrap the example model if the config asks for it and it is missing.
2. Start the local stack (:class:`services.supervisor.Stack`): embedded
   Redis, reward server, control plane, rollout server, learner.
3. Evaluate held-out accuracy before training, through the rollout and
   reward servers (:mod:`services.evaluate`); every sample must come from
   version 0.
4. Upload the training prompt set and start the run on the control plane;
   follow it with a progress bar until the learner finishes it.
5. Make the rollout server serve the final version and evaluate again.
6. Write ``summary.json`` and the report plots, stop the stack, move its
   directory to ``runs/<run_id>/`` and print that path as the last line.
7. Audit the run's ledger (:mod:`services.audit`, as ``tandem audit``) and
   put the verdict in ``summary.json`` as ``audit``.

Exit code 0 only when every step succeeded and the audit passed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import httpx
from rich.console import Console

from broker import Keys, WeightRegistry, connect
from services import wire
from services.audit import audit_file
from services.clients import ControlClient, RewardClient, RolloutClient
from services.config import RunConfig
from services.evaluate import EvalResult, evaluate, load_eval_set
from services.progress import progress_bar
from services.report import write_plots, write_summary
from services.runs import MetricsLog
from services.settings import StackSettings
from services.supervisor import Stack


class JobError(RuntimeError):
    """The main job could not complete; the message says which step failed."""


def ensure_model(config: RunConfig, console: Console) -> None:
    if (config.model.path / "config.json").exists():
        return
    if config.model.bootstrap is None:
        raise JobError(f"model.path {config.model.path} holds no model and model.bootstrap is not set")
    from examples.arith.bootstrap import SFT_STEPS, bootstrap

    console.print(f"bootstrapping the example model into {config.model.path} (a one-time cold start)")
    with progress_bar("bootstrap SFT", total=SFT_STEPS) as update:
        bootstrap(config.model.path, config.data.train,
                  progress=lambda s, n, loss: update(s, f"loss {loss:.3f}"))


async def _eval(stack: Stack, config: RunConfig, label: str) -> EvalResult:
    items = load_eval_set(config.data.eval, config, config.eval.max_prompts)
    async with RolloutClient(stack.url("rollout"), stack.token) as rollout, \
            RewardClient(stack.url("reward"), stack.token) as reward:
        with progress_bar(f"eval {label}", total=len(items)) as update:
            return await evaluate(rollout, reward, items, config, progress=lambda d: update(d))


async def _follow(stack: Stack, config: RunConfig, run_id: str) -> wire.RunStatus:
    async with ControlClient(stack.url("control"), stack.token) as control:
        with progress_bar("training", total=config.learner.steps) as update:
            while True:
                stack.check()  # restarts a crashed service (the control plane too: then try again)
                try:
                    st = await control.run_status(run_id)
                except httpx.TransportError:
                    await asyncio.sleep(1.0)
                    continue
                lag = st.staleness.max_observed_lag
                update(st.run.step, f"reward {st.reward_mean if st.reward_mean is not None else float('nan'):.2f}"
                                    f"  lag<={lag if lag is not None else '-'}  dropped {st.staleness.stale_dropped}")
                if st.run.state in wire.TERMINAL_STATES:
                    return st
                await asyncio.sleep(1.0)


async def _serve_final(stack: Stack, run_id: str, timeout_s: float = 120.0) -> int:
    """Make the rollout server serve the newest published version; return it."""
    redis = connect(stack.redis_url)
    try:
        latest = await WeightRegistry(redis, Keys(run_id)).latest()
    finally:
        await redis.aclose()
    if latest is None:
        raise JobError("the learner finished without publishing a weight version")
    async with RolloutClient(stack.url("rollout"), stack.token, max_total_s=timeout_s) as rollout:
        status = await rollout.load_weights(wire.LoadWeights(version=latest.version, uri=latest.uri, sha256=latest.sha256))
    if status.version != latest.version:
        raise JobError(f"rollout server serves version {status.version}, not the final {latest.version}")
    return latest.version


async def _record_eval(redis_url: str, run_id: str, step: int, result: EvalResult) -> None:
    redis = connect(redis_url)
    try:
        await MetricsLog(redis, Keys(run_id)).append("eval", step, accuracy=result.accuracy)
    finally:
        await redis.aclose()


def _stack_lines_only(console: Console):
    """Show the supervisor's own lines; the services' logs go to <run dir>/logs/ only."""
    def echo(line: str) -> None:
        if line.startswith("[stack]"):
            console.print(line, markup=False, highlight=False)

    return echo


def run_job(config_path: Path, config: RunConfig, settings: StackSettings, runs_root: Path = Path("runs")) -> Path:
    """Run the main job; return the run directory. Raises :class:`JobError` on failure."""
    console = Console()
    started = time.monotonic()
    ensure_model(config, console)
    if config.data.eval is None:
        raise JobError("data.eval is required: the main job reports held-out accuracy before and after")
    work = runs_root.resolve() / f".stack-{os.getpid()}"
    stack = Stack(work, settings, config=config_path, echo=_stack_lines_only(console))
    run_id = None
    try:
        with console.status("starting the stack (redis, reward, control, rollout, learner)"):
            stack.start()
        before = asyncio.run(_eval(stack, config, "before"))
        if before.versions != {0}:
            raise JobError(f"pre-training eval used policy versions {sorted(before.versions)}, expected [0]")
        console.print(f"held-out accuracy before: {before.accuracy:.1%} ({before.count} prompts)")

        async def submit() -> wire.RunCreated:
            async with ControlClient(stack.url("control"), stack.token) as control:
                info = await control.upload_prompt_set(config.data.train.read_bytes(), config.reward.type)
                return await control.create_run(info.id, config.model_dump(mode="json"))

        created = asyncio.run(submit())
        run_id = created.run_id
        asyncio.run(_record_eval(stack.redis_url, run_id, 0, before))
        console.print(f"run {run_id}: {created.groups} prompt groups queued")
        final = asyncio.run(_follow(stack, config, run_id))
        if final.run.state != "finished":
            raise JobError(f"run {run_id} ended {final.run.state}: {final.run.error}")
        version = asyncio.run(_serve_final(stack, run_id))
        after = asyncio.run(_eval(stack, config, "after"))
        if after.versions != {version}:
            raise JobError(f"post-training eval used versions {sorted(after.versions)}, expected [{version}]")
        asyncio.run(_record_eval(stack.redis_url, run_id, final.run.step, after))
        console.print(f"held-out accuracy after:  {after.accuracy:.1%} (policy version {version})")
        status = asyncio.run(_status(stack, run_id))
        points = asyncio.run(_metrics(stack, run_id))
    finally:
        stack.stop()
        if run_id is not None and work.exists():
            target = runs_root.resolve() / run_id
            if target.exists():
                shutil.rmtree(target)
            work.rename(target)
    run_dir = runs_root.resolve() / run_id
    write_plots(points, run_dir / "report")
    st = status.staleness
    summary = {
        "run_id": run_id,
        "config": str(config_path),
        "accuracy_before": before.accuracy,
        "accuracy_after": after.accuracy,
        "eval_prompts": before.count,
        "steps": status.run.step,
        "final_version": version,
        "samples": status.counters.get("produced", 0) * config.sampling.group_size,
        "groups_trained": status.counters.get("accepted", 0),
        "wall_s": round(time.monotonic() - started, 1),
        "max_staleness": st.max_staleness,
        "max_observed_lag": st.max_observed_lag,
        "stale_dropped": st.stale_dropped,
        "counters": status.counters,
        "throughput": status.throughput.model_dump(),
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


async def _status(stack: Stack, run_id: str) -> wire.RunStatus:
    async with ControlClient(stack.url("control"), stack.token) as control:
        return await control.run_status(run_id)


async def _metrics(stack: Stack, run_id: str) -> list[wire.MetricPoint]:
    async with ControlClient(stack.url("control"), stack.token) as control:
        return await control.metrics(run_id)
