"""The `kvgraft` command line: a thin typer + rich layer over the engine, the store and the flywheel.

Only this package prints or exits. `app` registers the commands; `grafts`, `flywheel`, `store` and `serve` hold
them; `options`, `engines`, `inputs`, `output` and `errors` are what they share.
"""

from kvgraft.cli.app import app, main

__all__ = ["app", "main"]
