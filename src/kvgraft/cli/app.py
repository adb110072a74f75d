"""The typer app: every command registered in one place, in the order `kvgraft --help` lists them."""

from __future__ import annotations

import typer

from kvgraft.cli import flywheel, grafts, keys, serve, store, transfer
from kvgraft.cli.errors import OneLineErrors, handle_errors

app = typer.Typer(
    name="kvgraft",
    help="Byte-exact KV-cache grafts: build, store, restore, generate and verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)
store_app = typer.Typer(help="The store as a whole.", no_args_is_help=True)
app.add_typer(store_app, name="store")
keys_app = typer.Typer(help="Signing keys for grafts.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

for name, command in (
    ("build", grafts.build),
    ("ls", grafts.list_grafts),
    ("inspect", grafts.inspect),
    ("generate", grafts.generate),
    ("verify", grafts.verify),
    ("rm", grafts.rm),
    ("sign", keys.sign),
    ("export", transfer.export),
    ("import", transfer.import_),
    ("harvest", flywheel.harvest),
    ("bench", flywheel.bench),
    ("demo", flywheel.demo),
    ("replicate", flywheel.replicate),
    ("serve", serve.serve),
):
    app.command(name)(handle_errors(command))
store_app.command("stats")(handle_errors(store.stats))
store_app.command("gc")(handle_errors(store.gc))
store_app.command("copy")(handle_errors(transfer.store_copy))
keys_app.command("new")(handle_errors(keys.keys_new))


def main() -> None:
    """Run the `kvgraft` command line (the console script's entry point)."""
    from transformers.utils import logging as transformers_logging

    # transformers draws its own bars while a checkpoint loads and saves; kvgraft's progress bars are the CLI's.
    transformers_logging.disable_progress_bar()
    app()
