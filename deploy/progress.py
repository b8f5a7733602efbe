"""Progress bars for long CLI work (rich), one shape for every command."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@contextmanager
def progress_bar(label: str, total: int | None) -> Iterator[Callable[[int, str], None]]:
    """Yield ``update(done, note)``; the bar closes when the block ends."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[note]}")]
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(label, total=total, note="")

        def update(done: int, note: str = "") -> None:
            progress.update(task, completed=done, note=note)

        yield update
