"""Signing keys and signatures: `kvgraft keys new` makes a writer's key pair, `kvgraft sign` signs stored grafts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvgraft.cli.options import JsonOpt, StoreOpt
from kvgraft.cli.output import emit, out
from kvgraft.format.signature import read_signing_key, write_key_pair
from kvgraft.store import open_store
from kvgraft.store.trust import sign_graft

DEFAULT_KEYS_DIR = Path("keys")


def keys_new(
    name: Annotated[str, typer.Argument(help="The key's name: the files are NAME.key and NAME.pub.")],
    directory: Annotated[
        Path, typer.Option("--dir", help="Where the key files go (created if missing).")
    ] = DEFAULT_KEYS_DIR,
    as_json: JsonOpt = False,
) -> None:
    """Make an ed25519 key pair: NAME.key signs grafts (keep it secret), NAME.pub goes to readers' --trusted-keys."""
    private_path, public_path, key = write_key_pair(directory, name)
    data = {"name": name, "key_id": key.public.id, "private_key": str(private_path), "public_key": str(public_path)}

    def render() -> None:
        out.print(
            f"key {key.public.id}: private {private_path} (keep it secret; sign with --key), "
            f"public {public_path} (put it in readers' --trusted-keys directory)",
            highlight=False,
            soft_wrap=True,
        )

    emit(as_json, data, render)


def sign(
    graft: Annotated[list[str], typer.Argument(help="Graft ids or prefixes.")],
    key: Annotated[Path, typer.Option("--key", "-k", help="The private key file (NAME.key of `kvgraft keys new`).")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Sign stored grafts: each signature is kept in the store beside its graft (signatures/<id>.<key id>.json)."""
    signing_key = read_signing_key(key)
    graft_store = open_store(store, must_exist=True)
    full = [graft_store.resolve(g) for g in graft]  # every id checked before anything is written
    signatures = [sign_graft(graft_store, graft_id, signing_key) for graft_id in full]
    data = {"key_id": signing_key.public.id, "signed": [s.graft_id for s in signatures]}
    lines = "\n".join(f"signed {s.graft_id} with key {s.key_id}" for s in signatures)
    emit(as_json, data, lambda: out.print(lines, highlight=False, soft_wrap=True))
