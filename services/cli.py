"""The ``tandem`` command line.

Light on purpose: importing this module pulls in no torch, vllm or
deepspeed (a test enforces it), so ``tandem --help`` answers at once. Each
command imports what it needs when it runs.
"""

from __future__ import annotations

import importlib
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="tandem",
    help="Asynchronous GRPO training as services: rollout (vLLM), reward (sandboxes), learner (DeepSpeed).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class ServiceName(str, Enum):
    control = "control"
    rollout = "rollout"
    reward = "reward"
    learner = "learner"


SERVICE_PACKAGES = {
    ServiceName.control: "services.control",
    ServiceName.rollout: "rollout_server",
    ServiceName.reward: "reward_server",
    ServiceName.learner: "learner",
}


def _fail(message: str, code: int = 2) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def serve(
    name: Annotated[ServiceName, typer.Argument(help="Which service to run.")],
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run config (TOML).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on (default TANDEM_HOST or 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (default TANDEM_PORT).")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="rollout: serve this model directory without a run config.")] = None,
) -> None:
    """Run one service in the foreground (docker-compose and Modal use this)."""
    from services.config import ConfigError, load_run_config
    from services.settings import ServiceSettings

    overrides = {k: v for k, v in {"host": host, "port": port, "model": model}.items() if v is not None}
    try:
        settings = ServiceSettings(**overrides)
        settings.check_auth_safe()
        run_config = load_run_config(config) if config else None
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    package = importlib.import_module(SERVICE_PACKAGES[name])
    if not hasattr(package, "serve"):
        _fail(f"service {name.value!r} is not available in this build")
    package.serve(settings, run_config)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Learner steps to simulate.")] = 12,
    max_staleness: Annotated[int, typer.Option("--max-staleness", help="eta, the staleness bound.")] = 1,
    run_dir: Annotated[Path, typer.Option(help="Where the embedded Redis keeps its AOF.")] = Path("runs/demo"),
) -> None:
    """Broker demo: trajectory groups through embedded Redis under a staleness bound."""
    from services.demo import run_demo

    raise typer.Exit(run_demo(steps=steps, max_staleness=max_staleness, run_dir=run_dir))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
