"""The one place a kvgraft error becomes a CLI message: one red line on stderr and exit code 1, never a traceback.

Core errors say what went wrong; the remedy, when it is a flag, is the CLI's to add (`hint_for`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec

import typer
from rich.markup import escape

from kvgraft.cli.output import err
from kvgraft.core.errors import EnvironmentMismatchError, KvgraftError, NotAChainError

P = ParamSpec("P")

HINTS: dict[type[KvgraftError], str] = {
    EnvironmentMismatchError: "pass --allow-env-mismatch to use it anyway, reported as not exact",
    NotAChainError: "build it with --after, or pass --approximate",
}
"""The flags that remedy an error, by the error's type."""


def hint_for(exc: KvgraftError) -> str:
    """The CLI's remedy for an error.

    Args:
        exc: the error a command raised.

    Returns:
        The hint for its type (or a base type), or "" when there is none.
    """
    return next((hint for kind, hint in HINTS.items() if isinstance(exc, kind)), "")


def error_line(exc: KvgraftError) -> str:
    """The one line an error is reported as.

    Args:
        exc: the error a command raised.

    Returns:
        Its message, followed by `; hint` when the CLI has one.
    """
    hint = hint_for(exc)
    return f"{exc}; {hint}" if hint else str(exc)


def handle_errors(func: Callable[P, None]) -> Callable[P, None]:
    """Wrap a command so that a kvgraft error ends it with one red `error:` line and exit code 1.

    Args:
        func: the command's function (typer reads its signature through the wrapper).

    Returns:
        The wrapped command.
    """

    @functools.wraps(func)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            func(*args, **kwargs)
        except KvgraftError as exc:
            err.print(f"[bold red]error:[/] {escape(error_line(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return run
