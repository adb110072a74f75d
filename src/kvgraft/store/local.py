"""A content-addressed store in a local directory.

Layout: <root>/grafts/<id>/manifest.json and <root>/grafts/<id>/tensors.safetensors (the graft's own small
tensors), and <root>/blocks/<2 hex>/<block key>.safetensors, one file per KV block, shared by every graft whose
tokens begin the same way. A put writes new blocks first (each to <root>/tmp/, fsynced, renamed into place), then
the graft directory the same way, so a crash leaves either no graft or a whole one, at worst with unreferenced
blocks that `gc` removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path

import torch

from kvgraft.core.errors import FormatError, IntegrityError, MissingBlockError, NotFoundError, StoreError
from kvgraft.core.hashing import BlockKey, GraftId, Sha256Hex
from kvgraft.format.blocks import BLOCK_SUFFIX
from kvgraft.format.manifest import (
    MANIFEST_NAME,
    BlockRef,
    Manifest,
    expected_block_shapes,
    manifest_bytes,
    parse_manifest,
)
from kvgraft.format.tensor_files import (
    block_file_bytes,
    declared_block_digest,
    read_block_checked,
    read_blocks_assembled,
    read_tensors_checked,
    tensors_file_bytes,
)
from kvgraft.store.base import (
    GC_GRACE_S,
    SIGNATURES_DIR,
    GcReport,
    GraftStore,
    StoredGraft,
    check_sidecar_name,
    manifest_keys,
    resolve_id,
    stored_block_digest,
)

STORE_ENV = "KVGRAFT_STORE"
DEFAULT_STORE_DIR = ".kvgraft"


def default_store_path() -> Path:
    return Path(os.environ.get(STORE_ENV) or DEFAULT_STORE_DIR)


def open_store(path: str | Path | None = None, must_exist: bool = False) -> GraftStore:
    """The store at `path` (default: $KVGRAFT_STORE, else .kvgraft).

    Args:
        path: A directory, or an s3://BUCKET/PREFIX URL (endpoint from AWS_ENDPOINT_URL, credentials from the
            standard AWS chain).
        must_exist: refuse a local directory that does not exist (commands that only read a store); otherwise it
            is created by the first put.

    Returns:
        An `S3Store` for an s3:// URL, a `LocalStore` otherwise.

    Raises:
        StoreError: a local path that exists but is not a directory.
        NotFoundError: with `must_exist`, a local path that does not exist.
    """
    target = path if path is not None else os.environ.get(STORE_ENV) or DEFAULT_STORE_DIR
    # A str, not a Path: Path("s3://b/p") would fold the double slash.
    if isinstance(target, str) and target.startswith("s3://"):
        try:
            from kvgraft.store.s3 import S3Store  # imported here: obstore is needed only for remote stores
        except ImportError as exc:
            raise StoreError(f"an s3:// store needs obstore ({exc.name} is missing): pip install obstore") from None
        return S3Store(target)
    root = Path(target)
    if root.exists() and not root.is_dir():
        raise StoreError(f"store path {root} is not a directory")
    if must_exist and not root.exists():
        raise NotFoundError(f"no store at {root}: nothing has been stored there (check --store or ${STORE_ENV})")
    return LocalStore(root)


class LocalStore:
    """Implements `GraftStore` in a directory (see the module docstring for the layout)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def directory(self) -> Path:
        return self.root

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

    @property
    def _blocks(self) -> Path:
        return self.root / "blocks"

    def block_path(self, key: str) -> Path:
        return self._blocks / key[:2] / f"{key}{BLOCK_SUFFIX}"

    def has_block(self, key: BlockKey) -> bool:
        return self.block_path(key).is_file()

    def read_block(
        self,
        key: BlockKey,
        block: BlockRef | None = None,
        shapes: dict[str, list[int]] | None = None,
        dtype: str | None = None,
    ) -> tuple[BlockRef, dict[str, torch.Tensor]]:
        """A block's tensors (memory-mapped), checked against `block` or, when None, the digest the file declares."""
        return read_block_checked(self.block_path(key), key, block, shapes, dtype)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive lock of the store's blocks: puts naming blocks and removals of blocks never interleave."""
        with (self.root / "lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def put(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        blocks: dict[BlockKey, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[GraftId, bool]:
        """Store a graft: the blocks given (by key) that the store lacks, then the graft directory.

        Every block the manifest lists must be given or already stored; a stored block must declare the same digest.
        """
        graft_id = manifest.id
        given = blocks or {}
        if (self._grafts / graft_id / MANIFEST_NAME).exists() and not self._damaged_parts(manifest, given):
            return graft_id, False
        self._ensure_writable()
        with self._locked():
            if (self._grafts / graft_id / MANIFEST_NAME).exists():
                self._repair_locked(manifest, tensors, given)
                return graft_id, False
            return self._put_locked(manifest, tensors, given)

    def _damaged_parts(self, manifest: Manifest, given: dict[BlockKey, dict[str, torch.Tensor]]) -> bool:
        """Whether a stored graft with this id has a damaged manifest or tensors file, or a damaged copy of a block the
        writer gave (one it can replace; the blocks it reused were checked as it read them)."""
        try:
            stored = self.manifest(manifest.id)
            read_tensors_checked(self._grafts / stored.id / stored.tensors_file, stored)
            for ref in manifest.blocks:
                if ref.key in given:
                    self.read_block(ref.key, ref)
        except NotFoundError:
            return False  # removed meanwhile: the locked put writes it whole
        except (FormatError, IntegrityError):
            return True
        return False

    def _repair_locked(
        self, manifest: Manifest, tensors: dict[str, torch.Tensor], given: dict[BlockKey, dict[str, torch.Tensor]]
    ) -> None:
        """Replace the damaged parts of a stored graft by the writer's: blocks it gave, then its own files, each
        atomically (so every reader sees either the damaged file, which it refuses, or the repaired one)."""
        for ref in manifest.blocks:
            if ref.key in given:
                self._put_block(ref, given[ref.key])
        final = self._grafts / manifest.id
        try:
            self.own_tensors(self.manifest(manifest.id))
            return
        except NotFoundError:
            return  # removed meanwhile: nothing to repair
        except (FormatError, IntegrityError):
            pass
        try:
            for name, data in ((manifest.tensors_file, tensors_file_bytes(tensors)), (MANIFEST_NAME, None)):
                self._replace_file(final / name, data if data is not None else manifest_bytes(manifest))
        except OSError as exc:
            raise StoreError(f"cannot repair graft in {self.root}: {exc.strerror or exc}") from None

    def _replace_file(self, path: Path, data: bytes) -> None:
        """Write `path` whole or not at all: a temporary file under tmp/, fsynced, renamed over it (the caller
        holds the lock, under which gc clears tmp/)."""
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}-", dir=self.root / "tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        _fsync_dir(path.parent)

    def _put_locked(
        self, manifest: Manifest, tensors: dict[str, torch.Tensor], given: dict[BlockKey, dict[str, torch.Tensor]]
    ) -> tuple[GraftId, bool]:
        graft_id = manifest.id
        final = self._grafts / graft_id
        written: list[Path] = []
        try:
            for ref in manifest.blocks:
                if self._put_block(ref, given.get(ref.key)):
                    written.append(self.block_path(ref.key))
            return self._commit(manifest, tensors, final)
        except StoreError:
            # A failed put (a full disk, a missing block) takes back the blocks it wrote: under the lock no other put
            # can have named them, and a build that read one meanwhile recomputes it when its put misses it.
            for path in written:
                path.unlink(missing_ok=True)
            raise

    def _commit(self, manifest: Manifest, tensors: dict[str, torch.Tensor], final: Path) -> tuple[GraftId, bool]:
        graft_id = manifest.id
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

    def _put_block(self, ref: BlockRef, tensors: dict[str, torch.Tensor] | None) -> bool:
        """Store one block unless an intact copy is there.

        Returns:
            Whether this call created the block file (False when it was there, intact or replaced because damaged).

        Raises:
            MissingBlockError: the writer reused the block and it is gone (removed since the writer read it).
        """
        path = self.block_path(ref.key)
        existed = path.is_file()
        if existed:
            stored = stored_block_digest(
                ref,
                tensors,
                lambda: declared_block_digest(path, ref.key),
                lambda: self.read_block(ref.key)[0].sha256,
            )
            if stored is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)  # fresh again, so gc's grace period keeps it
                    return False
        if tensors is None:
            raise MissingBlockError(
                f"block {ref.key[:12]} is neither stored nor given (removed while the graft was being built?); "
                "build the graft again"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # A concurrent writer of the same block writes the same bytes; a full disk keeps no half-written block.
            self._replace_file(path, block_file_bytes(tensors, ref.sha256))
        except OSError as exc:
            raise StoreError(f"cannot write block to {self.root}: {exc.strerror or exc}") from None
        return not existed

    def ids(self) -> list[GraftId]:
        if not self._grafts.is_dir():
            return []
        return sorted(GraftId(Sha256Hex(p.name)) for p in self._grafts.iterdir() if (p / MANIFEST_NAME).is_file())

    def change_token(self) -> Hashable | None:
        """The `grafts/` directory's modification time, link count and inode: every put and delete is a rename in
        it, by this process or any other. The link count tells apart two changes within one clock tick."""
        try:
            info = os.stat(self._grafts)
        except OSError:
            return ("empty",)  # no grafts directory yet: an empty store, until one appears
        return (info.st_mtime_ns, info.st_nlink, info.st_ino)

    def prefetch(self, graft_id: str) -> bool:
        """A local store has no faster tier of its own (the page cache is the OS's): nothing to start."""
        return False

    def read_sidecar(self, name: str) -> bytes | None:
        try:
            return (self.root / check_sidecar_name(name)).read_bytes()
        except OSError:
            return None

    def write_sidecar(self, name: str, data: bytes) -> None:
        if not self.root.is_dir():
            return  # an empty store that does not exist yet has nothing to keep
        final = self.root / check_sidecar_name(name)
        try:
            final.parent.mkdir(exist_ok=True)
            (self.root / "tmp").mkdir(exist_ok=True)
            # Under the lock, like every writer of tmp/: gc clears tmp/ under it, so it only ever clears litter.
            with self._locked():
                self._replace_file(final, data)
        except OSError:
            return  # a read-only store still works, from the manifests; a full disk keeps nothing half-written

    def resolve(self, id_or_prefix: str) -> GraftId:
        return resolve_id(
            id_or_prefix, self.location, lambda full: (self._grafts / full / MANIFEST_NAME).is_file(), self.ids
        )

    def manifest(self, graft_id: str) -> Manifest:
        full = self.resolve(graft_id)
        path = self._grafts / full / MANIFEST_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"no graft {graft_id} in store {self.location} (removed meanwhile)") from None
        manifest = parse_manifest(data, str(path))
        if manifest.id != full:
            raise FormatError(f"graft directory {full} holds graft {manifest.id}")
        return manifest

    def get(self, graft_id: str) -> StoredGraft:
        manifest = self.manifest(graft_id)
        try:
            tensors = read_tensors_checked(self._grafts / manifest.id / manifest.tensors_file, manifest)
            # Each block read into its place in the per-layer tensors and hashed there: one pass, no second copy.
            blocks = read_blocks_assembled(
                [(self.block_path(ref.key), ref) for ref in manifest.blocks],
                expected_block_shapes(manifest),
                manifest.dtype,
            )
        except FormatError:
            self._raise_if_removed(manifest.id)
            raise
        return StoredGraft(manifest, blocks | tensors)

    def _raise_if_removed(self, graft_id: GraftId) -> None:
        """A file of a graft missing because another process removed the graft meanwhile is no damage: NotFoundError
        says so. (A graft still listed whose file is missing is damaged, and its FormatError stands.)"""
        if not (self._grafts / graft_id / MANIFEST_NAME).is_file():
            raise NotFoundError(f"no graft {graft_id} in store {self.location} (removed meanwhile)") from None

    def delete(self, graft_id: str) -> None:
        """Remove a graft, then those of its blocks that no other graft names. A damaged graft's blocks are those its
        bytes may still name (`keys_named_in`); blocks beyond a truncation are left to `gc`."""
        full = self.resolve(graft_id)
        self._ensure_writable()
        blocks = self._named_blocks(full)
        with self._locked():
            # Rename first so that no reader ever sees half a graft; under the lock, since gc clears tmp/ under it.
            doomed = Path(tempfile.mkdtemp(prefix="rm-", dir=self.root / "tmp"))
            try:
                (self._grafts / full).rename(doomed / full)
            except FileNotFoundError:
                raise NotFoundError(f"no graft {graft_id} in store {self.location}") from None  # removed meanwhile
            finally:
                shutil.rmtree(doomed, ignore_errors=True)
            for signature in (self.root / SIGNATURES_DIR).glob(f"{full}.*.json"):
                signature.unlink(missing_ok=True)  # its writers' signatures go with it
            if blocks:
                self._remove_blocks(blocks - self.referenced_blocks(), grace_s=0.0)

    def _named_blocks(self, graft_id: GraftId) -> set[str]:
        def raw() -> bytes | None:
            try:
                return (self._grafts / graft_id / MANIFEST_NAME).read_bytes()
            except OSError:
                return None

        return manifest_keys(self, graft_id, raw)

    def referenced_blocks(self) -> set[str]:
        """Keys of every block some graft names; a damaged manifest's are every key its bytes may name, so that a
        graft that can still be repaired keeps its blocks."""
        return {key for graft_id in self.ids() for key in self._named_blocks(graft_id)}

    def block_files(self) -> list[Path]:
        return sorted(self._blocks.glob(f"*/*{BLOCK_SUFFIX}")) if self._blocks.is_dir() else []

    def gc(self, grace_s: float = GC_GRACE_S) -> GcReport:
        """Remove blocks no graft names and older than `grace_s`, and staging litter as old."""
        if not self.root.is_dir():
            return GcReport(0, 0, 0)
        self._ensure_writable()
        with self._locked():
            referenced = self.referenced_blocks()
            unreferenced = {p.name.removesuffix(BLOCK_SUFFIX) for p in self.block_files()} - referenced
            report = self._remove_blocks(unreferenced, grace_s)
            # Staging litter of interrupted puts, deletes and sidecar writes: every writer of tmp/ holds the lock, so
            # what is there now belongs to a writer that died.
            now = time.time()
            for entry in (self.root / "tmp").iterdir():
                with contextlib.suppress(OSError):
                    if now - entry.lstat().st_mtime >= grace_s:
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        return report

    def _remove_blocks(self, keys: Iterable[str], grace_s: float) -> GcReport:
        removed = freed = kept = 0
        now = time.time()
        for key in keys:
            path = self.block_path(key)
            try:
                stat = path.stat()
                if now - stat.st_mtime < grace_s:
                    kept += 1
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed, freed = removed + 1, freed + stat.st_size
        return GcReport(removed, freed, kept)

    def tensors_path(self, graft_id: str) -> str:
        manifest = self.manifest(graft_id)
        return str((self._grafts / manifest.id / manifest.tensors_file).resolve())

    def size_bytes(self, graft_id: str) -> int:
        """Bytes the graft takes on its own: its directory plus every block it names (shared or not; a block missing
        counts 0)."""
        full = self.resolve(graft_id)
        manifest = self.manifest(full)
        own = sum(_size(p) for p in _files_in(self._grafts / full))
        return own + sum(_size(self.block_path(ref.key)) for ref in manifest.blocks)

    def disk_bytes(self) -> int:
        """Bytes on disk: every graft directory and every block file, each block counted once (a file removed by
        another process during the walk counts 0)."""
        grafts = sum(_size(p) for d in self._grafts.glob("*") for p in _files_in(d))
        return grafts + sum(_size(p) for p in self.block_files())

    def own_tensors(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """The graft's tensors file (memory-mapped), checked against `manifest`; its blocks are not read."""
        try:
            return read_tensors_checked(self._grafts / manifest.id / manifest.tensors_file, manifest)
        except FormatError:
            self._raise_if_removed(manifest.id)
            raise


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _files_in(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


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
