"""The ``tandem`` command line.

Light on purpose: importing this module pulls in no torch, vllm or
deepspeed (a test enforces it), so ``tandem --help`` answers at once. Each
command imports what it needs when it runs.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from deploy.client import (
    control,
    fail,
    http_error,
    load_settings,
    on_redis,
    redis_url,
    runs_dir,
    stack_dir,
)
from deploy.prompts import app as prompts_app
from deploy.settings_reference import SETTINGS_REFERENCE, settings_classes, settings_reference

app = typer.Typer(
    name="tandem",
    help="Asynchronous GRPO training as services: rollout (vLLM), reward (sandboxes), learner (DeepSpeed).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(prompts_app, name="prompts")


class ServiceName(StrEnum):
    control = "control"
    rollout = "rollout"
    reward = "reward"
    learner = "learner"


SERVICE_PACKAGES = {
    ServiceName.control: "control_plane",
    ServiceName.rollout: "rollout_server",
    ServiceName.reward: "reward_server",
    ServiceName.learner: "learner",
}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@app.command()
def serve(
    name: Annotated[ServiceName, typer.Argument(help="Which service to run.")],
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run config (TOML).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on (default TANDEM_HOST or 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (default TANDEM_PORT).")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="rollout: serve this model directory without a run config.")] = None,
) -> None:
    """Run one service in the foreground (docker-compose and Modal use this).

    Every rank of a multi-rank learner runs this too:
    ``torchrun --nproc_per_node N -m deploy.cli serve learner --config RUN.toml`` (rank 0 serves HTTP).
    """
    from services.config import ConfigError, load_run_config

    if model is not None and name is not ServiceName.rollout:
        fail("--model is for `tandem serve rollout`")
    settings = load_settings(name.value, host=host, port=port, model=model)
    try:
        settings.check_auth_safe()
        run_config = load_run_config(config) if config else None
    except (ConfigError, ValueError) as e:
        fail(str(e))
    package = importlib.import_module(SERVICE_PACKAGES[name])
    if not hasattr(package, "serve"):
        fail(f"service {name.value!r} is not available in this build")
    package.serve(settings, run_config)


@app.command()
def config(
    name: Annotated[str | None, typer.Argument(help="control, rollout, reward, learner, stack or client (default: all).")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help=f"Print the settings reference ({SETTINGS_REFERENCE}) instead: every variable with its type, default and meaning.")] = False,
) -> None:
    """Print the effective settings (from TANDEM_* and REDIS_URL) as JSON, secrets masked.

    With ``--markdown``: the reference of every variable instead, generated from the settings
    classes and committed as docs/settings.md.
    """
    import json

    classes = settings_classes()
    if name is not None and name not in classes:
        fail(f"no settings named {name!r} (choose from {', '.join(classes)})")
    if markdown:
        typer.echo(settings_reference([name] if name else None), nl=False)
        return
    out = {}
    for key in [name] if name else classes:
        settings = load_settings(key)
        out[key] = settings.masked() if hasattr(settings, "masked") else settings.model_dump(mode="json")
    typer.echo(json.dumps(out[name] if name else out, indent=2))


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Run config (TOML), e.g. examples/arith/run.toml.")],
    runs_root: Annotated[Path | None, typer.Option("--runs", help="Where run directories go (default: TANDEM_RUN_DIR, else runs).")] = None,
) -> None:
    """The main job: start the stack, evaluate, train with GRPO, evaluate, write a report, stop.

    A mistake in the run's files (the config, the prompt sets it names) ends it with a line per mistake,
    ``tandem run: <file>: <what is wrong>; <what to change>``, and exit status 2, before anything starts
    where it can be checked up front; another failure with ``tandem run failed: ...`` and 1."""
    import signal

    from deploy.main_job import JobError, run_job
    from deploy.stack import StackError
    from services.config import ConfigError, load_run_config

    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the run like Ctrl-C: its services with it
    try:
        run_dir = run_job(config, load_run_config(config), load_settings("stack"), runs_dir(runs_root))
    except ConfigError as e:  # the user's files (services.config): no traceback
        fail("\n".join(f"tandem run: {line}" for line in str(e).splitlines()))
    except (JobError, StackError) as e:
        fail(f"tandem run failed: {e}", code=1)
    except KeyboardInterrupt:
        fail(f"tandem run stopped: interrupted; its services are stopped, its files are under {runs_dir(runs_root)}", code=130)
    typer.echo(str(run_dir))


@app.command("bootstrap-model")
def bootstrap_model(
    out: Annotated[Path, typer.Option("--out", help="Model directory to write.")] = Path("runs/models/arith"),
    data: Annotated[Path, typer.Option(help="Prompt set with answers to cold-start on.")] = Path("examples/arith/train.jsonl"),
    steps: Annotated[int | None, typer.Option(help="Supervised steps (default: the recipe's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed (the build is deterministic).")] = 0,
) -> None:
    """Build the small example policy offline (random Qwen3 + a short supervised cold start)."""
    from deploy.progress import progress_bar
    from examples.arith.bootstrap import SFT_STEPS, bootstrap, check_data
    from services.config import ConfigError

    if not data.exists():
        fail(f"{data}: no such prompt set")
    try:
        check_data(data)
    except ConfigError as e:
        fail(str(e))
    steps = steps or SFT_STEPS
    with progress_bar("bootstrap SFT", total=steps) as update:
        path = bootstrap(out, data, steps=steps, seed=seed, progress=lambda s, n, loss: update(s, f"loss {loss:.3f}"))
    typer.echo(str(path))


@app.command()
def up(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run config the stack serves.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Where logs, weights, Redis data and stack.json go (default: TANDEM_RUN_DIR, else runs/stack).")] = None,
    only: Annotated[str | None, typer.Option(help="Comma-separated subset of services to start.")] = None,
) -> None:
    """Start embedded Redis and every service, supervise them until Ctrl-C."""
    import os
    import signal

    from deploy.stack import SERVICES, Stack, StackError

    services = tuple(s.strip() for s in only.split(",")) if only else SERVICES
    unknown = set(services) - set(SERVICES)
    if unknown:
        fail(f"--only: unknown services {sorted(unknown)} (choose from {', '.join(SERVICES)})")
    stack = Stack(stack_dir(run_dir), load_settings("stack"), config=config, services=tuple(s for s in SERVICES if s in services))
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack like Ctrl-C
    try:
        stack.start()
        info = stack.write_info(os.getpid())  # 0600: it holds the token and the Redis password
        urls = ", ".join(f"{name} {stack.url(name)}" for name in stack.children)
        typer.secho(f"tandem is up: {urls} (token in {info})", fg=typer.colors.GREEN)
        stack.supervise()
    except StackError as e:
        fail(str(e), code=1)
    except KeyboardInterrupt:
        typer.echo("stopping ...")
    finally:
        stack.stop()


@app.command()
def submit(
    prompts: Annotated[Path | None, typer.Argument(help="Prompt set: JSON lines with 'prompt' (or 'messages', or "
                                                        "the fields of prompt.template) and reward-spec fields.")] = None,
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config (TOML).")] = ...,
    url: Annotated[str | None, typer.Option(help="Control plane URL (default: TANDEM_URL or the local stack).")] = None,
    prompt_set: Annotated[str | None, typer.Option("--prompt-set", help="Train on this stored prompt set (an id "
                                                                        "from `tandem prompts import`) instead of a file.")] = None,
    eval_prompt_set: Annotated[str | None, typer.Option("--eval-prompt-set", help="Held-out prompts: this stored "
                                                                                  "set instead of data.eval.")] = None,
) -> None:
    """Upload a prompt set (or name a stored one) and start a run on a control plane; print the run id."""
    import asyncio

    import httpx

    from services.config import ConfigError, load_run_config

    try:
        run_config = load_run_config(config)
    except ConfigError as e:
        fail(str(e))
    if (prompts is None) == (prompt_set is None):
        fail("give a prompt-set file or --prompt-set ID (one of them)")
    if prompts is not None and not prompts.exists():
        fail(f"{prompts}: no such file")

    async def go():
        async with control(url) as client:
            if prompt_set is not None:
                info = await client.prompt_set(prompt_set)
            else:
                info = await client.upload_prompt_set(prompts.read_bytes(), run_config.reward.type)
            held_out = eval_prompt_set
            if held_out is None and run_config.data.eval is not None:  # the rollout servers evaluate it during the run
                held_out = (await client.upload_prompt_set(run_config.data.eval.read_bytes(),
                                                           run_config.reward.type)).id
            created = await client.create_run(info.id, run_config.model_dump(mode="json"), held_out,
                                              client_run_dir=str(load_settings("client").run_dir.resolve()))
            return info, created

    try:
        info, created = asyncio.run(go())
    except httpx.HTTPError as e:
        fail(http_error(e), code=1)
    typer.echo(f"prompt set {info.id}: {info.count} prompts; run {created.run_id}: {created.groups} groups queued",
               err=True)
    typer.echo(created.run_id)


@app.command()
def status(
    run_id: Annotated[str | None, typer.Argument(help="Run to show (default: every run).")] = None,
    url: Annotated[str | None, typer.Option(help="Control plane URL (default: TANDEM_URL or the local stack).")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until the run ends.")] = False,
) -> None:
    """Show run progress: state, step, reward, accuracy, staleness, throughput, watchdog incidents."""
    import asyncio
    import time

    import httpx
    from rich.live import Live

    from deploy.progress import console
    from deploy.report import runs_table, status_table
    from services.run_states import TERMINAL_STATES

    async def fetch():
        async with control(url) as client:
            if run_id is None:
                return runs_table(await client.runs())
            st = await client.run_status(run_id)
            if not st.incidents:
                return status_table(st), st.run.state in TERMINAL_STATES
            from rich.console import Group
            from rich.table import Table

            from services.watchdog import message

            incidents = Table("time (UTC)", "source", "incident", title="watchdog incidents (newest first)")
            for inc in st.incidents:
                incidents.add_row(time.strftime("%H:%M:%S", time.gmtime(inc.at)), inc.source, message(inc))
            return Group(status_table(st), incidents), st.run.state in TERMINAL_STATES

    try:
        if run_id is None:
            console().print(asyncio.run(fetch()))
            return
        table, done = asyncio.run(fetch())
        if not watch:
            console().print(table)
            return
        with Live(table, refresh_per_second=2) as live:
            while not done:
                time.sleep(2)
                table, done = asyncio.run(fetch())
                live.update(table)
    except httpx.HTTPError as e:
        fail(http_error(e), code=1)


@app.command()
def runs(
    url: Annotated[str | None, typer.Option(help="Control plane URL (default: TANDEM_URL or the local stack).")] = None,
) -> None:
    """List the control plane's runs, newest first: state, step, policy version, prompt set."""
    import asyncio

    import httpx

    from deploy.progress import console
    from deploy.report import runs_table

    async def fetch():
        async with control(url) as client:
            return await client.runs()

    try:
        console().print(runs_table(asyncio.run(fetch())))
    except httpx.HTTPError as e:
        fail(http_error(e), code=1)


@app.command()
def stop(
    run_id: Annotated[str, typer.Argument(help="The run to stop (queued or running).")],
    url: Annotated[str | None, typer.Option(help="Control plane URL (default: TANDEM_URL or the local stack).")] = None,
) -> None:
    """Stop a queued or running run; the services let it go within a poll."""
    import asyncio

    import httpx

    async def go():
        async with control(url) as client:
            return await client.stop_run(run_id)

    try:
        record = asyncio.run(go())
    except httpx.HTTPError as e:
        fail(http_error(e), code=1)
    typer.echo(f"run {record.run_id}: {record.state}")


@app.command()
def audit(
    target: Annotated[str, typer.Argument(help="A run directory (runs/<run_id>) or ledger.jsonl; or a run id of a "
                                               "running stack.")],
    run_dir: Annotated[Path | None, typer.Option(help="The running stack's directory, for a run id (default: TANDEM_RUN_DIR, else runs/stack).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Check a run's trajectory ledger: every group accounted for once, none trained twice, staleness within
    eta, versions contiguous and loaded as published. Exits 1 on any violation."""
    import json

    from deploy.audit import audit as check
    from deploy.audit import audit_file

    path = Path(target)
    if path.exists():
        try:
            verdict = audit_file(path)
        except FileNotFoundError as e:
            fail(str(e))
    else:
        from broker import Keys
        from broker.ledger import Ledger

        url = redis_url(target, run_dir, f"{target}: no such file or directory")
        entries = on_redis(url, lambda redis: Ledger(redis, Keys(target)).read())
        if not entries:
            fail(f"run {target}: its ledger is empty (unknown run?)", code=1)
        verdict = check(entries)
    report = verdict.as_dict()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print_audit(report)
    raise typer.Exit(0 if verdict.ok else 1)


def _print_audit(r: dict) -> None:
    g, v = r["groups"], r["versions"]
    lines = [
        f"groups: {g['queued']} queued, {g['trained']} trained, {g['dropped']} dropped, {g['open']} open"
        f" ({'closed: ' + r['closed'] if r['closed'] else 'run not closed yet'})",
        "dropped by reason: " + (", ".join(f"{k} {n}" for k, n in r["dropped_by_reason"].items()) or "none"),
        "generated by: " + (", ".join(f"{k} {n}" for k, n in r["generated_by"].items()) or "none"),
        f"lost: {r['lost']}, trained twice: {r['trained_twice']}, steps: {r['steps']}, "
        f"max lag {r['max_lag']} (max_staleness {r['max_staleness']})",
        f"learner starts: {r['learner_starts']}, steps lost to crashes (retrained): {r['lost_steps']}",
        f"versions: {v['published']} published (last {v['last']}), retracted {v['retracted'] or 'none'}, "
        f"{v['loads_checked']} loads checked against their sha256",
    ]
    if (ep := r.get("episodes", {})).get("groups"):
        lines.append(f"episodes: {ep['groups']} trained groups were episodes, {ep['turns']} model turns, "
                     f"{ep['tool_calls']} tool calls ({ep['tool_errors']} answered with an error)")
    for line in lines:
        typer.echo(line)
    for line in r["first_violations"]:
        typer.secho(f"VIOLATION: {line}", fg=typer.colors.RED)
    if r["violations"] > len(r["first_violations"]):
        typer.secho(f"... and {r['violations'] - len(r['first_violations'])} more", fg=typer.colors.RED)
    typer.secho("audit: ok" if r["ok"] else f"audit: FAILED ({r['violations']} violations)",
                fg=typer.colors.GREEN if r["ok"] else typer.colors.RED)


@app.command()
def export(
    run: Annotated[str, typer.Argument(help="A run directory (runs/<run_id>, runs/stack/<run_id>) or a run id.")],
    out: Annotated[Path, typer.Argument(help="The folder to write (new, or empty).")],
    version: Annotated[str, typer.Option(help="A version number, 'best' (highest held-out score) or 'last'.")] = "last",
    lora: Annotated[str, typer.Option(help="LoRA runs: 'merged' (full weights) or 'adapter' (a PEFT adapter "
                                           "folder; runs with publish.lora_format = 'adapter').")] = "merged",
    max_shard_size: Annotated[str, typer.Option(help="Shard the weights above this size (5GB, 500MB, bytes).")] = "5GB",
    runs_root: Annotated[Path | None, typer.Option("--runs", help="Where tandem run leaves run directories (default: TANDEM_RUN_DIR, else runs).")] = None,
    stack_dir: Annotated[Path | None, typer.Option(help="The tandem up stack's directory (default: TANDEM_RUN_DIR, else runs/stack).")] = None,
) -> None:
    """Write a published weight version as a Hugging Face folder (config, tokenizer, safetensors)
    that transformers and vLLM load, or a LoRA run's version as a PEFT adapter folder."""
    from deploy import client
    from deploy.export import ExportError, choose_version, find_run, parse_size
    from deploy.export import export as write

    try:
        found = find_run(run, runs_dir(runs_root), client.stack_dir(stack_dir))
        chosen = choose_version(found, version)
        done = write(found, chosen, out, lora=lora, max_shard_bytes=parse_size(max_shard_size))
    except ExportError as e:
        fail(str(e), code=1)
    typer.echo(f"run {found.run_id} version {chosen} -> {done.path} ({done.kind}: {', '.join(done.files)})", err=True)
    typer.echo(str(done.path))


@app.command()
def trace(
    run: Annotated[str, typer.Argument(help="A run directory (runs/<run_id>) or the id of a run in the running "
                                            "stack's Redis (live or finished).")],
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Where to write (default: trace-<run>.json).")] = None,
    runs_root: Annotated[Path | None, typer.Option("--runs", help="Where tandem run leaves run directories (default: TANDEM_RUN_DIR, else runs).")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="The running stack's directory, for a run id (default: TANDEM_RUN_DIR, else runs/stack).")] = None,
) -> None:
    """Write the run's timeline (every service's spans, incidents) as Chrome/Perfetto trace-event JSON: open it in
    ui.perfetto.dev. See docs/trace.md."""

    from deploy import trace as tr

    path = Path(run) if Path(run).exists() else runs_dir(runs_root) / run
    if path.is_dir() and any([(path / "timeline.jsonl").exists(), *(p.exists() for p in path.glob("*/timeline.jsonl"))]):
        spans, incidents = tr.from_run_dir(path)
        name = path.resolve().name
    else:
        url = redis_url(run, run_dir, f"{run}: no run directory with a timeline.jsonl")
        spans, incidents = on_redis(url, lambda redis: tr.from_redis(redis, run))
        name = run
    if not spans:
        fail(f"run {run}: no spans recorded (unknown run?)", code=1)
    target = out or Path(f"trace-{name}.json")
    trace = tr.write(target, spans, incidents)
    typer.echo(f"{len(spans)} spans, {len(incidents)} incidents over "
               f"{max(s.end for s in spans) - min(s.start for s in spans):.1f} s -> {target} "
               f"({len(trace['traceEvents'])} trace events; open it in https://ui.perfetto.dev)")


@app.command()
def deploy(
    target: Annotated[str, typer.Argument(help="Where to deploy (modal).")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config (TOML) the deployed services serve.")],
    modal_toml: Annotated[Path | None, typer.Option("--modal-toml", help="TOML file with a [modal] table (GPUs, containers).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and the command; deploy nothing.")] = False,
) -> None:
    """Deploy the services as a Modal app: `modal deploy -m deploy.modal_app` for this run config (the plan,
    role by role, is printed first)."""
    import os
    import shlex
    import subprocess
    import sys

    from deploy.config import describe, load_deploy
    from services.config import ConfigError, load_run_config

    if target != "modal":
        fail(f"unknown deploy target {target!r} (choose from: modal)")
    if modal_toml is not None and not modal_toml.exists():
        fail(f"{modal_toml}: no such file")
    try:
        run_config = load_run_config(config)
        plan = describe(load_deploy(modal_toml), run_config.name)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    env = {"DEPLOY_RUN_CONFIG": str(config.resolve())}
    if modal_toml is not None:
        env["DEPLOY_MODAL_TOML"] = str(modal_toml.resolve())
    cmd = [sys.executable, "-m", "modal", "deploy", "-m", "deploy.modal_app"]
    typer.echo("\n".join(plan), err=True)
    typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd), err=True)
    if dry_run:
        return
    raise typer.Exit(subprocess.call(cmd, env={**os.environ, **env}))


@app.command()
def plan(
    model: Annotated[str, typer.Option("--model", help="Preset, e.g. qwen3-8b-base (case-insensitive).")],
    mode: Annotated[str, typer.Option(help="lora, qlora or full.")] = "lora",
    gpus: Annotated[str, typer.Option(help="The learner's GPUs as Modal spells them: 8xH100 or H100:8.")] = "1xH100",
    rollout_gpus: Annotated[str | None, typer.Option(
        "--rollout-gpus", help="GPUs of one rollout server's model replica (vLLM tensor parallel), separate from the "
        "learner's as on Modal; default: the fewest of the learner's type that fit (1, 2, 4 or 8).")] = None,
    colocated: Annotated[bool, typer.Option(
        "--colocated", help="The rollout engine shares the learner's GPUs (one machine running both; vLLM "
        "tensor-parallel over all of them).")] = False,
    group_size: Annotated[int, typer.Option("--group-size", help="Completions per prompt (G).")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per completion (L).")] = 1024,
    micro_batch_tokens: Annotated[int | None, typer.Option(
        "--micro-batch-tokens", help="learner.micro_batch_tokens: tokens per micro-batch (default: the learner's).")] = None,
    logit_chunk_tokens: Annotated[int | None, typer.Option(
        "--logit-chunk-tokens", help="learner.logit_chunk_tokens: tokens whose logits the learner holds at once "
        "(default: the learner's).")] = None,
    zero_stage: Annotated[int | None, typer.Option(
        "--zero-stage", help="ZeRO stage 0-3 (default: the lowest that fits).")] = None,
    offload: Annotated[bool | None, typer.Option(
        "--offload/--no-offload", help="Optimizer state (and, at ZeRO-3, parameters) on CPU, or never (default: "
        "without if anything fits so, else with).")] = None,
    no_checkpointing: Annotated[bool, typer.Option("--no-checkpointing", help="Plan without activation checkpointing.")] = False,
    beta: Annotated[float, typer.Option(help="loss.beta; above 0 a full run holds a reference model.")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Estimate per-GPU memory of a GRPO run on --gpus, searching what is not given (ZeRO stage, offload, the
    rollout's tensor-parallel size) for a setting that fits; exit 0 if one does, 2 if not (then name a larger
    configuration that fits), 1 on bad input."""
    import json

    from deploy import plan as planner
    from deploy.presets import preset

    options = {"--zero-stage": zero_stage, "--offload" if offload else "--no-offload": offload,
               "--rollout-gpus": rollout_gpus}
    pinned = [name for name, value in options.items() if value is not None]  # the rest is searched
    try:
        p = preset(model)
        kwargs = dict(group_size=group_size, max_tokens=max_tokens, checkpointing=not no_checkpointing, beta=beta,
                      micro_batch_tokens=planner.MICRO_BATCH_TOKENS if micro_batch_tokens is None else micro_batch_tokens,
                      logit_chunk_tokens=planner.LOGIT_CHUNK_TOKENS if logit_chunk_tokens is None else logit_chunk_tokens,
                      zero_stage=zero_stage, offload=offload, rollout_gpus=rollout_gpus, colocated=colocated)
        result = planner.search(p, mode, gpus, **kwargs)
        # the hint is strictly larger than --gpus: on these GPUs nothing left open fits
        smallest = None if result.fits else planner.smallest_fit(p, mode, gpus, more_than=result.gpus, **kwargs)
        # what was given may be all that stands in the way on these GPUs
        free = planner.search(p, mode, gpus, **kwargs | dict(zero_stage=None, offload=None, rollout_gpus=None))
        searched = free.choice if pinned and free.fits and not result.fits else None
    except ValueError as e:
        fail(str(e), code=1)  # 2 means "does not fit"
    if as_json:
        out = result.model_dump(mode="json") | {
            "activations": result.activations, "total": result.total, "budget": result.budget, "fits": result.fits,
            "rollout": result.rollout, "rollout_budget": result.rollout_budget, "rollout_fits": result.rollout_fits,
            "pinned": pinned, "fits_if_searched": searched, "smallest_fit": smallest.label if smallest else None,
        }
        typer.echo(json.dumps(out, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{p.short_name} {result.mode} on {result.label}")
        table.add_column("component")
        table.add_column("GB per GPU", justify="right")
        ckpt = "checkpointed" if result.checkpointing else "no checkpointing"
        rows = [
            ("learner weights", result.weights), ("gradients", result.gradients), ("optimizer", result.optimizer),
            (f"activations ({ckpt})", result.activations), ("reference model", result.reference),
        ]
        rollout = [("rollout weights", result.rollout_weights), ("KV cache", result.kv_cache)]
        rows += [*rollout, ("runtime", result.runtime)] if result.colocated else [("runtime", result.runtime)]
        for name, gb in rows:
            table.add_row(name, f"{gb:.1f}")
        table.add_row("total" if result.colocated else "learner GPU total", f"{result.total:.1f}", style="bold")
        table.add_row(f"budget ({planner.HEADROOM:.0%} of {result.gpu_memory:g})", f"{result.budget:.1f}")
        if not result.colocated:
            for name, gb in [*rollout, ("runtime", result.runtime)]:
                table.add_row(f"{name} (rollout GPU)", f"{gb:.1f}")
            table.add_row(f"rollout GPU total (of {result.rollout_gpus})", f"{result.rollout:.1f}", style="bold")
            table.add_row(f"vLLM budget ({planner.ROLLOUT_FRACTION:.0%} of {result.rollout_gpu_memory:g})",
                          f"{result.rollout_budget:.1f}")
        console = Console()
        console.print(table)
        given = f" with {', '.join(pinned)} as given" if pinned else ""
        if result.fits:
            console.print(f"[green]fits[/green]: {result.gpus}x{result.gpu}, {result.choice}{given}")
        else:
            hint = (f"smallest that fits: {smallest.label} ({smallest.choice})" if smallest
                    else f"no fit up to 16x{result.gpu}{given}")
            if searched:
                hint = f"without {', '.join(pinned)} it fits here: {searched}; {hint}"
            console.print(f"[red]does not fit[/red] on {result.gpus}x{result.gpu}{given} (nearest: {result.choice}); "
                          f"{hint}")
    raise typer.Exit(0 if result.fits else 2)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
