"""A content-addressed store in a local directory.

Layout: <root>/grafts/<id>/manifest.json and <root>/grafts/<id>/tensors.safetensors. A put writes both files
into <root>/tmp/, fsyncs them, then renames the directory into place in one step, so a crash leaves either no
graft or a whole one.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from kvgraft.errors import NotFoundError, StoreError
from kvgraft.graft_format import (
    MANIFEST_NAME,
    Manifest,
    manifest_bytes,
    parse_manifest,
    read_tensors_checked,
    tensors_file_bytes,
)
from kvgraft.hashing import Sha256Hex
from kvgraft.store.base import StoredGraft

STORE_ENV = "KVGRAFT_STORE"
DEFAULT_STORE_DIR = ".kvgraft"
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


def default_store_path() -> Path:
    return Path(os.environ.get(STORE_ENV) or DEFAULT_STORE_DIR)


def open_store(path: str | Path | None = None) -> LocalStore:
    return LocalStore(Path(path) if path is not None else default_store_path())


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def _grafts(self) -> Path:
        return self.root / "grafts"

    def _ensure_writable(self) -> None:
        try:
            self._grafts.mkdir(parents=True, exist_ok=True)
            (self.root / "tmp").mkdir(exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(f"store path {self.root} is not a directory") from None
        except OSError as exc:
            raise StoreError(f"cannot create store at {self.root}: {exc.strerror}") from None
        if not os.access(self.root / "tmp", os.W_OK):
            raise StoreError(f"store at {self.root} is not writable")

    def put(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> tuple[Sha256Hex, bool]:
        graft_id = manifest.id
        final = self._grafts / graft_id
        if (final / MANIFEST_NAME).exists():
            return graft_id, False
        self._ensure_writable()
        try:
            staging = Path(tempfile.mkdtemp(prefix=f"{graft_id[:12]}-", dir=self.root / "tmp"))
        except OSError as exc:
            raise StoreError(f"store at {self.root} is not writable: {exc.strerror}") from None
        try:
            _write_synced(staging / manifest.tensors_file, tensors_file_bytes(tensors))
            _write_synced(staging / MANIFEST_NAME, manifest_bytes(manifest))
            _fsync_dir(staging)
            try:
                staging.rename(final)
            except OSError:
                # Another writer put the same content first: the graft is there, ours is redundant.
                if (final / MANIFEST_NAME).exists():
                    return graft_id, False
                raise
            _fsync_dir(self._grafts)
        except OSError as exc:
            raise StoreError(f"cannot write graft to {self.root}: {exc.strerror or exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return graft_id, True

    def ids(self) -> list[Sha256Hex]:
        if not self._grafts.is_dir():
            return []
        return sorted(Sha256Hex(p.name) for p in self._grafts.iterdir() if (p / MANIFEST_NAME).is_file())

    def resolve(self, id_or_prefix: str) -> Sha256Hex:
        prefix = id_or_prefix.strip().lower()
        if not _HEX.match(prefix):
            raise NotFoundError(f"{id_or_prefix!r} is not a graft id (hex digits expected)")
        if len(prefix) == 64:  # a full id: one stat, not a listing of the whole store
            if (self._grafts / prefix / MANIFEST_NAME).is_file():
                return Sha256Hex(prefix)
            raise NotFoundError(f"no graft {id_or_prefix} in store {self.root}")
        matches = [i for i in self.ids() if i.startswith(prefix)]
        if not matches:
            raise NotFoundError(f"no graft {id_or_prefix} in store {self.root}")
        if len(matches) > 1:
            raise NotFoundError(
                f"graft id prefix {id_or_prefix} is ambiguous ({len(matches)} grafts); give more digits"
            )
        return matches[0]

    def manifest(self, graft_id: str) -> Manifest:
        full = self.resolve(graft_id)
        path = self._grafts / full / MANIFEST_NAME
        manifest = parse_manifest(path.read_bytes(), str(path))
        if manifest.id != full:
            raise NotFoundError(f"graft directory {full} holds graft {manifest.id}")
        return manifest

    def get(self, graft_id: str) -> StoredGraft:
        manifest = self.manifest(graft_id)
        tensors = read_tensors_checked(self._grafts / manifest.id / manifest.tensors_file, manifest)
        return StoredGraft(manifest, tensors)

    def delete(self, graft_id: str) -> None:
        full = self.resolve(graft_id)
        self._ensure_writable()
        # Rename first so that no reader ever sees half a graft.
        doomed = Path(tempfile.mkdtemp(prefix="rm-", dir=self.root / "tmp"))
        (self._grafts / full).rename(doomed / full)
        shutil.rmtree(doomed, ignore_errors=True)

    def tensors_path(self, graft_id: str) -> str:
        manifest = self.manifest(graft_id)
        return str((self._grafts / manifest.id / manifest.tensors_file).resolve())

    def size_bytes(self, graft_id: str) -> int:
        full = self.resolve(graft_id)
        return sum(p.stat().st_size for p in (self._grafts / full).iterdir())


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
