"""Progress for long CLI work, one shape for every command: a rich bar on a terminal, plain lines elsewhere.

On a terminal (``tandem run`` and ``tandem bootstrap-model`` in a shell) the bar redraws in place.
Written to a log file or a pipe (CI, ``nohup``, a job scheduler) a bar is useless: rich draws it
once, at 80 columns, with its figures cut (``training ━━━━ 150… 0:0…``). There each update that
matters is one full line instead (:class:`PlainProgress`): every :data:`PLAIN_EVERY_STEPS` steps or
:data:`PLAIN_EVERY_S` seconds, whichever comes first, whenever the caller marks an event (a new
held-out evaluation), and the last. :func:`console` is the console the CLI prints tables with: wide
enough off a terminal that ``tandem status`` in a log is not cut either.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PLAIN_EVERY_STEPS = 10
PLAIN_EVERY_S = 30.0
WIDE = 1000
"""Columns of :func:`console` off a terminal: rich cuts a table to the console's width, and a log has none."""


def console() -> Console:
    """A console for the CLI's tables: the terminal's width on a terminal, else :data:`WIDE` (nothing cut)."""
    plain = Console()
    return plain if plain.is_terminal else Console(width=WIDE)


class PlainProgress:
    """``update(done, note, mark=False)`` printed as a full line when due (module docstring)."""

    def __init__(self, label: str, total: int | None, out=None) -> None:
        self.label, self.total, self.out = label, total, out or sys.stdout
        self.done, self.note = 0, ""
        self.printed: int | None = None  # the count of the last line printed
        self.at = time.monotonic()

    def update(self, done: int, note: str = "", mark: bool = False) -> None:
        self.done, self.note = done, note
        due = (self.printed is None or done - self.printed >= PLAIN_EVERY_STEPS
               or time.monotonic() - self.at >= PLAIN_EVERY_S)
        if mark or (due and done != self.printed) or (self.total is not None and done >= self.total):
            self._line()

    def close(self) -> None:
        if self.printed != self.done:
            self._line()

    def _line(self) -> None:
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        print(f"{self.label}: {count}" + (f"  {self.note}" if self.note else ""), file=self.out, flush=True)
        self.printed, self.at = self.done, time.monotonic()


@contextmanager
def progress_bar(label: str, total: int | None) -> Iterator[Callable[..., None]]:
    """Yield ``update(done, note="", mark=False)`` (``mark``: an event worth a line of its own off a
    terminal); the bar closes when the block ends."""
    if not Console().is_terminal:
        plain = PlainProgress(label, total)
        try:
            yield plain.update
        finally:
            plain.close()
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[note]}")]
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(label, total=total, note="")

        def update(done: int, note: str = "", mark: bool = False) -> None:
            progress.update(task, completed=done, note=note)

        yield update
