"""The `kvgraft` command line: a thin typer + rich layer over the engine, the store and the flywheel."""

from kvgraft.cli.main import app, main

__all__ = ["app", "main"]
