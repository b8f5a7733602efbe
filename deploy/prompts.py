"""``tandem prompts``: import a dataset as a prompt set, list, show and delete stored sets.

Light like ``deploy.cli`` (a test imports the CLI without torch, vllm or datasets): each
command imports what it needs when it runs, and talks to the control plane through
``deploy.client``. ``import`` reads the dataset with
``deploy.datasets`` and streams the lines to the control plane; the control plane validates
and stores them (all or nothing) as it does an uploaded file.
"""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(name="prompts", help="Prompt sets on the control plane: import a dataset, list, show, delete.",
                  no_args_is_help=True)

UrlOption = Annotated[str | None, typer.Option(help="Control plane URL (default: TANDEM_URL or the local stack).")]


@app.command("import")
def import_(
    source: Annotated[str, typer.Argument(help="A .jsonl/.parquet/.csv file, a `save_to_disk` directory, or a "
                                               "Hugging Face hub dataset id.")],
    map_: Annotated[list[str], typer.Option("--map", help="FIELD=COLUMN[,FIELD=COLUMN...]: put a column under a "
                                                          "line field (prompt, messages, answer, ...).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="FIELD=VALUE: the same value in every line "
                                                                 "(JSON if it parses, else text).")] = None,
    reward: Annotated[str | None, typer.Option(help="Reward type written into every line (math, exact, "
                                                    "numeric, ...); default: the run's reward.type.")] = None,
    split: Annotated[str | None, typer.Option(help="Split of a dataset dict or hub dataset (default train).")] = None,
    subset: Annotated[str | None, typer.Option(help="Configuration of a hub dataset.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Import at most this many rows.")] = None,
    url: UrlOption = None,
) -> None:
    """Read a dataset, map its columns to prompt-set fields and store it on the control plane; print its id.

    Bad rows are reported by number (from 1, in the dataset's order) and nothing is stored."""
    import asyncio

    import httpx

    from deploy.client import control, fail, http_error
    from deploy.datasets import (
        ImportProblem,
        chunks,
        constant,
        open_source,
        parse_pairs,
        prompt_lines,
    )
    from services.reward_specs import REWARD_TYPES

    if reward is not None and (reward not in REWARD_TYPES or reward == "combined"):
        fail(f"--reward {reward}: unknown reward type (choose from "
              f"{', '.join(t for t in REWARD_TYPES if t != 'combined')})")
    try:
        mapping = parse_pairs(map_, "--map")
        constants = [(k, constant(v)) for k, v in parse_pairs(set_ or [], "--set")]
        opened = open_source(source, split=split, subset=subset)
        lines = prompt_lines(opened, mapping, constants, reward, limit)
        first = next(lines, None)  # a missing column is reported before anything is sent
    except ImportProblem as e:
        fail(str(e))
    if first is None:
        fail(f"{source}: no rows to import")

    async def body():
        for chunk in chunks(_chain(first, lines)):
            yield chunk

    async def go():
        async with control(url) as client:
            return await client.upload_prompt_set(body(), reward or "math")

    try:
        info = asyncio.run(go())
    except ImportProblem as e:
        fail(f"{e} (nothing was stored)")
    except httpx.HTTPStatusError as e:
        fail(_row_errors(e) or http_error(e), code=1)
    except httpx.HTTPError as e:
        fail(http_error(e), code=1)
    forms = ", ".join(f"{k} {n}" for k, n in sorted(info.forms.items()))
    typer.echo(f"imported {info.count} rows of {opened.description} as prompt set {info.id}"
               + (f" ({forms})" if forms else ""), err=True)
    typer.echo(info.id)


def _chain(first: bytes, rest):
    yield first
    yield from rest


def _row_errors(e) -> str | None:
    """A 422's per-line problems as rows (row N is line N of the upload), or None."""
    try:
        body = e.response.json()
    except ValueError:
        return None
    errors = body.get("errors") if isinstance(body, dict) else None
    if e.response.status_code != 422 or not errors:
        return None
    shown = []
    for err in errors:
        where = f"row {err['line']}: " if err.get("line") else ""
        shown.append(f"{where}{err['field']}: {err['msg']}" if err.get("field") else f"{where}{err['msg']}")
    return "the control plane refused the import (nothing was stored):\n" + "\n".join(shown)


def _client_call(url: str | None, call):
    """Run ``call(client)`` against the control plane; a failure ends the command naming the cause."""
    import asyncio

    import httpx

    from deploy.client import control, fail, http_error

    async def go():
        async with control(url) as client:
            return await call(client)

    try:
        return asyncio.run(go())
    except httpx.HTTPError as e:
        fail(http_error(e), code=1)


def _table(sets, title: str):
    import time

    from rich.table import Table

    table = Table("id", "lines", "bytes", "created (UTC)", "reward types", "prompt forms", title=title)
    for s in sets:
        table.add_row(s.id, str(s.count), str(s.bytes), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.created_at)),
                      ", ".join(f"{k} {n}" for k, n in sorted(s.reward_types.items())),
                      ", ".join(f"{k} {n}" for k, n in sorted(s.forms.items())))
    return table


@app.command("list")
def list_(
    url: UrlOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Stored prompt sets, newest first."""
    import json

    from deploy.progress import console

    sets = _client_call(url, lambda c: c.prompt_sets())
    if as_json:
        typer.echo(json.dumps([s.model_dump(mode="json") for s in sets], indent=2))
    else:
        console().print(_table(sets, "prompt sets"))


@app.command()
def show(
    set_id: Annotated[str, typer.Argument(help="Prompt set id (ps-...).")],
    url: UrlOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """One stored prompt set: lines, bytes, reward types and prompt forms."""
    from deploy.progress import console

    info = _client_call(url, lambda c: c.prompt_set(set_id))
    if as_json:
        typer.echo(info.model_dump_json(indent=2))
    else:
        console().print(_table([info], f"prompt set {info.id}"))


@app.command()
def delete(
    set_id: Annotated[str, typer.Argument(help="Prompt set id (ps-...).")],
    url: UrlOption = None,
) -> None:
    """Delete a stored prompt set (runs already created from it keep their prompts)."""
    info = _client_call(url, lambda c: c.delete_prompt_set(set_id))
    typer.echo(f"deleted prompt set {info.id} ({info.count} lines)")
