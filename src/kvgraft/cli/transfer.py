"""Moving grafts between stores: `store copy`, `export` and `import` (a bundle: a tar of a store layout plus
receipts, docs/FORMAT.md "Bundles")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from kvgraft.cli.options import JsonOpt, StoreOpt
from kvgraft.cli.output import emit, out, progress
from kvgraft.core.errors import NotFoundError
from kvgraft.store import GraftStore, open_store
from kvgraft.store.transfer import (
    BundleResult,
    CopyResult,
    ReceiptFile,
    check_receipt,
    copy_grafts,
    export_bundle,
    import_bundle,
    stored_receipt,
)

_RECEIPT_ID = re.compile(r"[0-9a-f]{64}")  # used with fullmatch


def store_copy(
    src: Annotated[str, typer.Argument(help="Source store: a directory or s3://BUCKET/PREFIX.")],
    dst: Annotated[str, typer.Argument(help="Destination store: a directory or s3://BUCKET/PREFIX.")],
    grafts: Annotated[
        list[str] | None, typer.Argument(help="Graft ids or unique prefixes (default: every graft of SRC).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy grafts between stores, every hash checked, each block once; run it again to resume."""
    source, destination = open_store(src, must_exist=True), open_store(dst)
    with progress("copying", not as_json) as on_step:
        result = copy_grafts(source, destination, grafts or None, on_step)
    emit(as_json, result.to_json(), lambda: out.print(_copy_line(result), highlight=False, soft_wrap=True))


def export(
    grafts: Annotated[list[str], typer.Argument(help="Graft ids or unique prefixes to put in the bundle.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The bundle (a tar file) to write.")],
    receipts: Annotated[
        list[str] | None,
        typer.Option(
            "--receipts",
            "--receipt",
            "-r",
            help="A receipt to add: a JSON file, or the id of a receipt the store keeps (repeatable).",
        ),
    ] = None,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write grafts and receipts to a tar bundle that is itself a store: check it with docs/FORMAT.md's checker."""
    graft_store = open_store(store, must_exist=True)
    checked = [_receipt(given, graft_store) for given in receipts or []]
    with progress("exporting", not as_json) as on_step:
        result = export_bundle(graft_store, grafts, checked, output, on_step)
    emit(as_json, result.to_json(), lambda: out.print(_bundle_line("wrote", result), highlight=False, soft_wrap=True))


def import_(
    bundle: Annotated[Path, typer.Argument(help="A bundle written by `kvgraft export` (a tar file).")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Import a bundle's grafts and receipts into the store, every entry and hash checked first."""
    graft_store = open_store(store)
    with progress("importing", not as_json) as on_step:
        result = import_bundle(bundle, graft_store, on_step)
    emit(
        as_json, result.to_json(), lambda: out.print(_bundle_line("imported", result), highlight=False, soft_wrap=True)
    )


def _receipt(given: str, store: GraftStore) -> ReceiptFile:
    """A receipt named on the command line: a file, else the id of a receipt the store keeps."""
    path = Path(given)
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise NotFoundError(f"cannot read receipt {given}: {exc.strerror}") from None
        return check_receipt(data, given)
    if _RECEIPT_ID.fullmatch(given):
        return stored_receipt(store, given)
    raise NotFoundError(f"no receipt file {given} (nor a 64-hex-digit receipt id)")


def _copy_line(result: CopyResult) -> str:
    return (
        f"copied {len(result.copied)} grafts ({len(result.skipped)} already there), {result.blocks_copied} blocks "
        f"({result.blocks_skipped} already there), {result.bytes_copied:,} bytes: "
        f"{result.source} -> {result.destination}"
    )


def _bundle_line(verb: str, result: BundleResult) -> str:
    copied = result.copy
    receipts = f"{len(result.receipts)} receipts" + (
        f" ({len(result.receipts_skipped)} already there)" if result.receipts_skipped else ""
    )
    where = f"to {result.bundle}" if verb == "wrote" else f"from {result.bundle} into {copied.destination}"
    return (
        f"{verb} {len(copied.copied)} grafts ({len(copied.skipped)} already there), {copied.blocks_copied} blocks "
        f"({copied.blocks_skipped} already there), {receipts}, {copied.bytes_copied:,} bytes {where}"
    )
