"""`kvgraft store ...`: commands on the store as a whole."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kvgraft.cli.options import JsonOpt, StoreOpt
from kvgraft.cli.output import emit, out
from kvgraft.store import open_store


def stats(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Grafts, tokens, bytes on disk and the dedup ratio of the store (from its persistent index)."""
    from kvgraft.library.index import store_stats

    data = store_stats(open_store(store, must_exist=True)).to_json()

    def render() -> None:
        table = Table("measure", "value")
        for key, value in data.items():
            table.add_row(key, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}")
        out.print(table)

    emit(as_json, data, render)


def gc(
    store: StoreOpt = None,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            help="Keep unreferenced blocks younger than this many seconds (a build may be about to name them).",
        ),
    ] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Remove KV blocks that no graft names any more (left by an interrupted build)."""
    report = open_store(store, must_exist=True).gc(grace)

    def render() -> None:
        line = f"removed {report.removed:,} unreferenced blocks, {report.freed_bytes:,} bytes"
        if report.kept_young:
            line += (
                f"; kept {report.kept_young:,} blocks younger than the grace period ({grace:g} s: a build may be"
                " about to name them); --grace 0 to remove them"
            )
        out.print(line)

    emit(as_json, report.to_json(), render)
