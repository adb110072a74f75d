"""Everything the CLI prints: JSON or rich tables on stdout, progress bars and errors on stderr."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvgraft.core.decode import TokenCallback
from kvgraft.core.schedule import ChunkCallback

out = Console()
err = Console(stderr=True)


def emit(as_json: bool, data: Any, render: Callable[[], None]) -> None:
    """Print a command's result: `data` as one line of JSON, or whatever `render` prints for people.

    Args:
        as_json: print JSON (`--json`) instead of calling `render`.
        data: the result as JSON-serialisable values.
        render: prints the result as tables or text on `out`.
    """
    if as_json:
        typer.echo(json.dumps(data))
    else:
        render()


@contextmanager
def progress(label: str, enabled: bool) -> Iterator[ChunkCallback | None]:
    """A progress bar on stderr for long work (off for --json and when stderr is not a terminal).

    Args:
        label: what the bar says is going on.
        enabled: False turns the bar off (the `--json` commands pass `not as_json`).

    Yields:
        A `(done, total)` callback that moves the bar, or None when there is no bar.
    """
    with progress_with_tokens(label, enabled) as (update, _):
        yield update


@contextmanager
def progress_with_tokens(label: str, enabled: bool) -> Iterator[tuple[ChunkCallback | None, TokenCallback | None]]:
    """`progress`, with the tokens generated so far counted in the bar's label (long budgets run for minutes
    between two items).

    Args:
        label: what the bar says is going on.
        enabled: False turns the bar off.

    Yields:
        The `(done, total)` callback and a per-token callback; both None when there is no bar.
    """
    if not enabled or not err.is_terminal:
        yield None, None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        generated = [0]

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def token(_: int) -> None:
            generated[0] += 1
            if generated[0] % 64 == 0:  # a redraw per token would cost more than the token
                bar.update(task, description=f"{label} ({generated[0]:,} tokens generated)")

        yield update, token
