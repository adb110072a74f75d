"""The one place a kvgraft error becomes a CLI message: one red line on stderr and exit code 1, never a traceback.

Core errors say what went wrong; the remedy, when it is a flag, is the CLI's to add (`hint_for`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec

import typer
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer 0.2x vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as click_errors  # type: ignore[no-redef]

from kvgraft.cli.output import err
from kvgraft.core.errors import EnvironmentMismatchError, KvgraftError, NotAChainError, UntrustedGraftError

P = ParamSpec("P")

HINTS: dict[type[KvgraftError], str] = {
    EnvironmentMismatchError: "pass --allow-env-mismatch to use it anyway, reported as not exact",
    NotAChainError: "build it with --after, or pass --approximate",
    UntrustedGraftError: "sign it with `kvgraft sign ID --key NAME.key`, or add its signer's .pub to --trusted-keys",
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


def _fail(line: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    sys.exit(1)


class OneLineErrors(TyperGroup):
    """The command group whose usage errors (a bad value, an unknown option) are one `error:` line and exit code 1,
    like every other bad input, instead of click's boxed usage message and exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        standalone = kwargs.pop("standalone_mode", True)
        kwargs["standalone_mode"] = False
        if not standalone:
            return super().main(*args, **kwargs)
        try:
            code = super().main(*args, **kwargs)
        except click_errors.NoArgsIsHelpError as exc:
            typer.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(exc.exit_code)
        except click_errors.UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            _fail(f"{exc.format_message()}{where}")
        except click_errors.ClickException as exc:  # a file option that cannot be opened, and the like
            _fail(exc.format_message())
        except typer.Abort:
            _fail("aborted")
        sys.exit(code if isinstance(code, int) else 0)
