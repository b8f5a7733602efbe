"""The CLI as a client: its settings, the control plane, the local stack's files and Redis.

Every ``tandem`` command that talks to something goes through here: ``deploy.cli`` (submit, status,
runs, stop, audit, trace, export, up) and ``deploy.prompts`` (``tandem prompts``). Light like the CLI:
each helper imports what it needs when it is called.

Where things are on this machine (docs/architecture.md section 8), one rule: the command's flag when
given, else ``TANDEM_RUN_DIR``, else the default. The local stack's directory (:func:`stack_dir`:
``--run-dir``, default ``runs/stack``): ``tandem up`` writes its ``stack.json`` (URLs, token, Redis
URL) there and the clients read it from there. ``tandem run``'s run directories (:func:`runs_dir`:
``--runs``, default ``runs``).

A user's mistake ends the command with one line on stderr (:func:`fail`), never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer

DEFAULT_STACK_DIR = Path("runs/stack")
"""``tandem up``'s directory when neither ``--run-dir`` nor ``TANDEM_RUN_DIR`` names one."""


def fail(message: str, code: int = 2) -> NoReturn:
    """End the command: ``message`` in red on stderr, exit ``code`` (2: the user's input; 1: a failure)."""
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def load_settings(name: str, **overrides):
    """``name``'s settings from the environment (checked against every class) and CLI overrides; a bad
    variable ends the command naming it and the form it takes."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError as ParseError

    from deploy.settings_reference import settings_classes
    from services.settings import SettingsError, check_environment

    classes = settings_classes()
    try:
        check_environment(classes.values())
        return classes[name](**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as e:
        fail(str(e))
    except ParseError as e:
        fail(_parse_error(classes[name], e))
    except ValidationError as e:
        fail(f"settings of {name}: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))


def _parse_error(cls: type, e: Exception) -> str:
    """One line for pydantic-settings' "error parsing value for field" (a list or mapping variable that is
    not JSON): the variable and the form it takes."""
    import os
    import re
    import types
    import typing

    match = re.search(r'field "(\w+)"', str(e))
    field = cls.model_fields.get(match.group(1)) if match else None
    if field is None:
        return f"settings: {e}"
    alias = field.validation_alias
    variable = alias if isinstance(alias, str) else f"{cls.model_config.get('env_prefix', '')}{match.group(1)}".upper()
    hint = field.annotation
    kinds = {typing.get_origin(a) or a for a in (typing.get_args(hint) if typing.get_origin(hint) in
                                                  (typing.Union, types.UnionType) else (hint,))}
    raw = os.environ.get(variable, "")
    if kinds & {list, set, tuple, frozenset}:
        return f"{variable}: expected a JSON list, e.g. '{json.dumps([raw] if raw else ['...'])}'"
    if dict in kinds:
        return f"{variable}: expected a JSON object, e.g. '{{\"key\": ...}}' (`tandem config --markdown` shows its form)"
    return f"{variable}: cannot parse {raw!r} (`tandem config --markdown` shows its form)"


def stack_dir(flag: Path | None = None) -> Path:
    """The local stack's directory: ``flag`` (``--run-dir``) when given, else ``TANDEM_RUN_DIR``, else
    ``runs/stack``."""
    if flag is not None:
        return flag
    client = load_settings("client")
    return client.run_dir if "run_dir" in client.model_fields_set else DEFAULT_STACK_DIR


def runs_dir(flag: Path | None = None) -> Path:
    """Where ``tandem run`` leaves run directories: ``flag`` (``--runs``) when given, else ``TANDEM_RUN_DIR``,
    else ``runs``."""
    return flag if flag is not None else load_settings("client").run_dir


def stack_info(run_dir: Path | None = None) -> dict | None:
    """The running stack's ``stack.json`` (URLs, token, Redis URL) in :func:`stack_dir`, or None."""
    info = stack_dir(run_dir) / "stack.json"
    return json.loads(info.read_text()) if info.exists() else None


def control(url: str | None, run_dir: Path | None = None):
    """A control-plane client: ``url`` (--url), else TANDEM_URL, else the local stack's ``stack.json``,
    else http://127.0.0.1:8000."""
    from services.clients import ControlClient

    client = load_settings("client")
    token = client.token.get_secret_value() if client.token else None
    url = url or client.url
    if url is None and (stack := stack_info(run_dir)) is not None:
        url, token = stack["urls"]["control"], token or stack["token"]
    return ControlClient(url or "http://127.0.0.1:8000", token, attempts=3)


def http_error(e) -> str:
    """A failed control-plane call as one line: the status, the route and the server's message."""
    import httpx

    if isinstance(e, httpx.HTTPStatusError):
        try:
            body = e.response.json()
            detail = body.get("message") or body.get("detail")
        except ValueError:
            detail = e.response.text
        return f"{e.response.status_code} from {e.request.url.path}: {detail}"
    return f"cannot reach the control plane: {e}"


def redis_url(run_id: str, run_dir: Path | None, not_found: str) -> str:
    """The Redis URL holding run ``run_id``'s streams: REDIS_URL, else the running stack's. Ends the command
    naming ``not_found`` when ``run_id`` is not a run id or no Redis is known."""
    from broker.keys import check_run_id

    try:
        check_run_id(run_id)
    except ValueError as e:
        fail(f"{not_found}, and not a run id: {e}")
    secret = load_settings("client").redis_url
    url = secret.get_secret_value() if secret else None
    if not url and (stack := stack_info(run_dir)) is not None:
        url = stack.get("redis_url")
    if not url:
        fail(f"{not_found}, and no running stack in {stack_dir(run_dir)} (or REDIS_URL) to read run {run_id} from")
    return url


def on_redis(url: str, read):
    """``await read(redis)`` on a connection to ``url``, closed afterwards."""
    import asyncio

    from broker import connect

    async def run():
        redis = connect(url)
        try:
            return await read(redis)
        finally:
            await redis.aclose()

    return asyncio.run(run())
