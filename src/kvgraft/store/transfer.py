"""Moving grafts between stores: `copy_grafts` from any store to any other, and bundles, a tar that is itself a
store layout plus receipts (`export_bundle`, `import_bundle`; docs/FORMAT.md, "Bundles").

Every manifest, block and tensors file is read through the store interface, so each is hash-checked on the way; a
block shared by several grafts is read and written once; and a copy is resumable: a graft the destination already
holds is skipped, and so is a block it already holds (shared with a graft it has, or left by an interrupted run).
The destination's `put` commits each graft's manifest last, so an interrupted copy never leaves a partial graft.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from kvgraft.core.errors import BadInputError, FormatError, NotFoundError, StoreError
from kvgraft.core.hashing import BlockKey, GraftId
from kvgraft.format.blocks import BLOCK_SUFFIX
from kvgraft.format.manifest import MANIFEST_NAME, BlockRef, Manifest, expected_block_shapes
from kvgraft.format.receipt import parse_receipt
from kvgraft.store.base import RECEIPTS_DIR, GraftStore
from kvgraft.store.local import LocalStore

ProgressCallback = Callable[[int, int], None]
"""Called with (steps done, steps in all); a step is one block read or one graft committed."""
READ_WORKERS = 8
"""Blocks read at once from the source: overlaps network round trips, bounds the memory held."""
BUNDLE_DIRS = ("grafts", "blocks", RECEIPTS_DIR)
"""The top-level directories of a bundle, in the order they are written."""

_HEX64 = r"[0-9a-f]{64}"
_FILE_ENTRY = re.compile(
    rf"grafts/{_HEX64}/[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors|grafts/{_HEX64}/{re.escape(MANIFEST_NAME)}"
    rf"|blocks/(?P<kk>[0-9a-f]{{2}})/(?P<key>{_HEX64}){re.escape(BLOCK_SUFFIX)}|{RECEIPTS_DIR}/{_HEX64}\.json"
)
_DIR_ENTRY = re.compile(rf"grafts(/{_HEX64})?|blocks(/[0-9a-f]{{2}})?|{RECEIPTS_DIR}")


@dataclass
class CopyResult:
    """What `copy_grafts` did."""

    source: str
    destination: str
    copied: list[GraftId] = field(default_factory=list)
    """Grafts written to the destination, in the order they were."""
    skipped: list[GraftId] = field(default_factory=list)
    """Grafts the destination already held."""
    blocks_copied: int = 0
    """Distinct blocks read from the source and written to the destination."""
    blocks_skipped: int = 0
    """Distinct blocks of the copied grafts the destination already held (not read from the source)."""
    bytes_copied: int = 0
    """Tensor bytes copied: blocks and the grafts' own tensors (file headers and manifests not counted)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "copied": list(self.copied),
            "skipped": list(self.skipped),
            "blocks_copied": self.blocks_copied,
            "blocks_skipped": self.blocks_skipped,
            "bytes_copied": self.bytes_copied,
        }


@dataclass(frozen=True)
class ReceiptFile:
    """A receipt's file, checked (`parse_receipt`): its id and its bytes as they were given."""

    receipt_id: str
    data: bytes


@dataclass
class BundleResult:
    """What `export_bundle` or `import_bundle` did."""

    bundle: str
    """The bundle file."""
    bundle_bytes: int
    copy: CopyResult
    """The grafts copied (into the bundle, or out of it into the store)."""
    receipts: list[str] = field(default_factory=list)
    """Receipt ids written (into the bundle, or into the store)."""
    receipts_skipped: list[str] = field(default_factory=list)
    """Receipt ids the store already held (import)."""

    def to_json(self) -> dict[str, Any]:
        return self.copy.to_json() | {
            "bundle": self.bundle,
            "bundle_bytes": self.bundle_bytes,
            "receipts": list(self.receipts),
            "receipts_skipped": list(self.receipts_skipped),
        }


# --- copying ---------------------------------------------------------------------------------------------------


def copy_grafts(
    src: GraftStore,
    dst: GraftStore,
    ids: Iterable[str] | None = None,
    on_progress: ProgressCallback | None = None,
) -> CopyResult:
    """Copy grafts from `src` to `dst`, each block once, every byte hash-checked as it is read.

    Every manifest is read (and checked) before anything is written. Then, graft by graft: the blocks the
    destination lacks are read from the source (concurrently, each checked against the manifest), then the graft's
    own tensors, then `dst.put` writes the blocks and commits the manifest last. A failure (a damaged block, a
    callback that raises) therefore leaves the grafts already copied whole and the current one absent; running
    the copy again skips what is there.

    Args:
        src: The store to read.
        dst: The store to write.
        ids: Graft ids or unique prefixes, in the order to copy; None copies every graft of `src`.
        on_progress: Called with (steps done, steps in all) once at the start and after each block read and each
            graft committed.

    Returns:
        The grafts copied and skipped, and the blocks and bytes copied.

    Raises:
        NotFoundError: `src` is a local directory that does not exist, or an id matches no graft (or several).
        BadInputError: `src` and `dst` are the same store.
        IntegrityError, FormatError: a manifest, block or tensors file of `src` does not match its hashes.
        StoreError: a store cannot be read or written.
    """
    _check_pair(src, dst)
    result = CopyResult(src.location, dst.location)
    wanted = src.ids() if ids is None else _resolve_all(src, ids)
    manifests: list[Manifest] = []
    for graft_id in wanted:
        if _has_graft(dst, graft_id):
            result.skipped.append(graft_id)
        else:
            manifests.append(src.manifest(graft_id))
    needed = _distinct_blocks(manifests)
    with _pool() as pool:
        present = {key for key, there in zip(needed, pool.map(dst.has_block, needed), strict=True) if there}
        result.blocks_skipped = len(present)
        steps = _Steps(len(needed) - len(present) + len(manifests), on_progress)
        written: set[str] = set(present)
        for manifest in manifests:
            refs = [ref for ref in manifest.blocks if ref.key not in written]
            blocks = _read_blocks(src, manifest, refs, pool, steps)
            own = src.own_tensors(manifest)
            _, created = dst.put(manifest, own, blocks)
            written.update(blocks)
            result.blocks_copied += len(blocks)
            result.bytes_copied += sum(_nbytes(tensors) for tensors in blocks.values()) + _nbytes(own)
            (result.copied if created else result.skipped).append(manifest.id)
            steps.advance()
    return result


def _check_pair(src: GraftStore, dst: GraftStore) -> None:
    if src.directory is not None and not src.directory.is_dir():
        raise NotFoundError(f"no store at {src.location}")
    same_directory = (
        src.directory is not None and dst.directory is not None and src.directory.resolve() == dst.directory.resolve()
    )
    if same_directory or src.location == dst.location:
        raise BadInputError(f"source and destination are the same store ({src.location})")


def _resolve_all(store: GraftStore, ids: Iterable[str]) -> list[GraftId]:
    """Full ids of `ids` (prefixes allowed), each once, in the order given."""
    return list(dict.fromkeys(store.resolve(graft) for graft in ids))


def _has_graft(store: GraftStore, graft_id: GraftId) -> bool:
    """Whether the store holds this graft (a full id: one stat or HEAD, no listing)."""
    try:
        store.resolve(graft_id)
    except NotFoundError:
        return False
    return True


def _distinct_blocks(manifests: list[Manifest]) -> list[BlockKey]:
    """Every block key the manifests name, each once, in first-use order."""
    return list(dict.fromkeys(ref.key for manifest in manifests for ref in manifest.blocks))


def _read_blocks(
    src: GraftStore, manifest: Manifest, refs: list[BlockRef], pool: ThreadPoolExecutor, steps: _Steps
) -> dict[BlockKey, dict[str, torch.Tensor]]:
    """The blocks `refs` of one graft, read concurrently, each checked against the manifest's digest, shapes, dtype.

    Returns:
        Tensors by block key, `layers.<i>.key` / `.value` of [1, kv_heads, C, head_dim] each.
    """
    shapes = expected_block_shapes(manifest)
    read = pool.map(lambda ref: src.read_block(ref.key, ref, shapes, manifest.dtype), refs)
    blocks: dict[BlockKey, dict[str, torch.Tensor]] = {}
    for ref, (_, tensors) in zip(refs, read, strict=True):
        blocks[ref.key] = tensors
        steps.advance()
    return blocks


@contextlib.contextmanager
def _pool() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="kvgraft-copy")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failure stops the reads that have not started


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _Steps:
    """Counts steps and reports them to a progress callback."""

    def __init__(self, total: int, callback: ProgressCallback | None) -> None:
        self.done, self.total, self.callback = 0, total, callback
        if callback is not None:
            callback(0, total)

    def advance(self) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total)


# --- receipts --------------------------------------------------------------------------------------------------


def receipt_sidecar(receipt_id: str) -> str:
    """The sidecar name under which a store keeps a receipt: `receipts/<id>.json`."""
    return f"{RECEIPTS_DIR}/{receipt_id}.json"


def check_receipt(data: bytes, where: str) -> ReceiptFile:
    """Check a receipt's bytes (JSON, version, hashes, id) before they go into a bundle or a store.

    Args:
        data: The receipt file's bytes.
        where: Names the receipt in messages (a path).

    Returns:
        The receipt's id and its bytes, unchanged.

    Raises:
        FormatError: not UTF-8, or not a valid receipt (`parse_receipt`).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{where}: receipt is not UTF-8 text") from None
    return ReceiptFile(parse_receipt(text, where).id, data)


def stored_receipt(store: GraftStore, receipt_id: str) -> ReceiptFile:
    """A receipt the store keeps (`receipts/<id>.json`, as `kvgraft serve` writes them), checked.

    Raises:
        NotFoundError: the store keeps no receipt with this id.
        FormatError: the stored receipt is damaged.
    """
    data = store.read_sidecar(receipt_sidecar(receipt_id))
    if data is None:
        raise NotFoundError(f"no receipt {receipt_id} in store {store.location}")
    return check_receipt(data, f"{store.location}/{receipt_sidecar(receipt_id)}")


def keep_receipt(store: GraftStore, receipt: ReceiptFile) -> bool:
    """Keep a checked receipt in the store as `receipts/<id>.json`, unless a valid one with its id is there.

    Returns:
        Whether it was written (False: the store had it already).

    Raises:
        StoreError: the store did not keep it (read-only, or a local store that does not exist).
    """
    name = receipt_sidecar(receipt.receipt_id)
    existing = store.read_sidecar(name)
    if existing is not None:
        with contextlib.suppress(FormatError):
            if check_receipt(existing, name).receipt_id == receipt.receipt_id:
                return False  # the same receipt; its created_at and timings may differ, its id says they agree
    store.write_sidecar(name, receipt.data)
    if store.read_sidecar(name) != receipt.data:  # write_sidecar keeps nothing, silently, where it cannot write
        raise StoreError(f"store {store.location} did not keep receipt {receipt.receipt_id[:16]} (not writable?)")
    return True


# --- bundles ---------------------------------------------------------------------------------------------------


def export_bundle(
    src: GraftStore,
    ids: list[str],
    receipts: list[ReceiptFile],
    out: Path,
    on_progress: ProgressCallback | None = None,
) -> BundleResult:
    """Write a bundle: a tar of a store layout holding the grafts (with their blocks) and the receipts.

    The grafts are copied (hash-checked) into a staging store beside `out`, the receipts written under
    `receipts/`, and the tar written to a temporary file renamed onto `out`: `out` is either the whole bundle or
    untouched.

    Args:
        src: The store holding the grafts.
        ids: Graft ids or unique prefixes.
        receipts: Checked receipts (`check_receipt`, `stored_receipt`).
        out: The tar file to write.
        on_progress: As in `copy_grafts`.

    Returns:
        The bundle's path and size, the grafts and blocks in it, and the receipt ids.

    Raises:
        BadInputError: nothing to export, or `out`'s directory does not exist.
        And what `copy_grafts` raises.
    """
    if not ids and not receipts:
        raise BadInputError("nothing to export: name at least one graft or receipt")
    if not out.parent.is_dir():
        raise BadInputError(f"cannot write {out}: {out.parent} is not a directory")
    staging = Path(tempfile.mkdtemp(prefix=".kvgraft-export-", dir=out.parent))
    try:
        bundle_store = LocalStore(staging / "store")
        copied = copy_grafts(src, bundle_store, ids, on_progress) if ids else CopyResult(src.location, str(out))
        copied.destination = str(out)  # not the staging directory, which is gone when this returns
        for receipt in receipts:
            path = staging / "store" / receipt_sidecar(receipt.receipt_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(receipt.data)
        _write_tar(staging / "store", staging / "bundle.tar")
        os.replace(staging / "bundle.tar", out)
    except OSError as exc:
        raise BadInputError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    receipt_ids = list(dict.fromkeys(receipt.receipt_id for receipt in receipts))
    return BundleResult(str(out), out.stat().st_size, copied, receipt_ids)


def _write_tar(root: Path, target: Path) -> None:
    """Tar the bundle directories of `root`: regular files only, names relative to `root`, sorted, owner 0."""
    now = int(time.time())
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for top in BUNDLE_DIRS:
            for path in sorted(p for p in (root / top).rglob("*") if p.is_file()):
                info = tarfile.TarInfo(path.relative_to(root).as_posix())
                info.size, info.mtime, info.mode = path.stat().st_size, now, 0o644
                with path.open("rb") as handle:
                    tar.addfile(info, handle)


def import_bundle(bundle: Path, dst: GraftStore, on_progress: ProgressCallback | None = None) -> BundleResult:
    """Import a bundle into a store: check every entry, extract, copy every graft hash-checked, keep the receipts.

    Every tar entry is checked before anything is extracted: only regular files and directories at the names of a
    bundle (docs/FORMAT.md, "Bundles"); an absolute path, `..`, a link, a device or any other name refuses the
    whole bundle and nothing is written. The extracted tree is then opened as a local store and copied with
    `copy_grafts` (every manifest, block and tensors file checked); receipts are checked before any graft is
    copied and kept as the store's `receipts/<id>.json` after.

    Args:
        bundle: The tar file (plain or compressed).
        dst: The store to import into.
        on_progress: As in `copy_grafts`.

    Returns:
        The grafts and blocks copied and skipped, and the receipts kept and skipped.

    Raises:
        BadInputError: not a readable tar, or an unsafe or unexpected entry.
        FormatError: a receipt or manifest of the bundle is malformed, or a graft directory lacks its manifest.
        And what `copy_grafts` raises.
    """
    staging = Path(tempfile.mkdtemp(prefix="kvgraft-import-"))
    try:
        _extract(bundle, staging)
        receipts = _bundle_receipts(bundle, staging)
        for graft_dir in sorted((staging / "grafts").glob("*")):
            if not (graft_dir / MANIFEST_NAME).is_file():
                raise FormatError(f"{bundle}: grafts/{graft_dir.name} has no {MANIFEST_NAME}")
        copied = copy_grafts(LocalStore(staging), dst, None, on_progress)
        copied.source = str(bundle)  # not the staging directory, which is gone when this returns
        result = BundleResult(str(bundle), bundle.stat().st_size, copied)
        for receipt in receipts:
            (result.receipts if keep_receipt(dst, receipt) else result.receipts_skipped).append(receipt.receipt_id)
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract(bundle: Path, into: Path) -> None:
    """Check every entry of the tar, then write its regular files under `into` (no tarfile extraction is used)."""
    if not bundle.is_file():
        raise NotFoundError(f"no bundle file {bundle}")
    try:
        with tarfile.open(bundle, "r:*") as tar:
            members = tar.getmembers()
            files = _checked_files(bundle, members)
            for member, name in files:
                source = tar.extractfile(member)
                if source is None:
                    raise BadInputError(f"{bundle}: cannot read entry {member.name!r}")
                target = into / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with source, target.open("wb") as handle:
                    shutil.copyfileobj(source, handle)
    except tarfile.ReadError:
        raise BadInputError(f"{bundle}: not a readable tar bundle (truncated, or not a tar file)") from None
    except (tarfile.TarError, EOFError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInputError(f"{bundle}: damaged tar bundle ({detail})") from None
    except OSError as exc:
        raise BadInputError(f"cannot import {bundle}: {exc.strerror or exc}") from None


def _checked_files(bundle: Path, members: list[tarfile.TarInfo]) -> list[tuple[tarfile.TarInfo, str]]:
    """The regular files of a bundle with their normalized names; raises on the first unsafe or unexpected entry.

    Returns:
        (member, name relative to the bundle root) per regular file, in tar order.
    """
    files: list[tuple[tarfile.TarInfo, str]] = []
    seen: set[str] = set()
    for member in members:
        why = _unsafe(member)
        path = PurePosixPath(member.name)
        name = "/".join(part for part in path.parts if part != ".")
        if why is None and not _expected(name, member.isdir()):
            why = "not a file of a bundle (grafts/, blocks/, receipts/ of a store layout)"
        if why is None and member.isfile() and name in seen:
            why = "appears twice"
        if why is not None:
            raise BadInputError(f"{bundle}: refusing unsafe bundle entry {member.name!r}: {why}; nothing was imported")
        if member.isfile():
            seen.add(name)
            files.append((member, name))
    return files


def _unsafe(member: tarfile.TarInfo) -> str | None:
    """Why a tar entry must never be extracted, or None."""
    path = PurePosixPath(member.name)
    if path.is_absolute():
        return "absolute path"
    if ".." in path.parts:
        return "path climbs out with '..'"
    if member.issym() or member.islnk():
        return "symbolic link" if member.issym() else "hard link"
    if member.ischr() or member.isblk():
        return "device"
    if member.issparse() or not (member.isfile() or member.isdir()):
        return "special file"
    return None


def _expected(name: str, is_dir: bool) -> bool:
    """Whether `name` is where a bundle keeps a file (or a directory, when `is_dir`)."""
    if is_dir:
        return name == "" or _DIR_ENTRY.fullmatch(name) is not None  # "" is the bundle root ("." or "./")
    match = _FILE_ENTRY.fullmatch(name)
    return match is not None and (match.group("kk") is None or match.group("key")[:2] == match.group("kk"))


def _bundle_receipts(bundle: Path, root: Path) -> list[ReceiptFile]:
    """The extracted receipts, each checked, each named by its own id."""
    receipts = []
    for path in sorted((root / RECEIPTS_DIR).glob("*.json")):
        where = f"{bundle}:{RECEIPTS_DIR}/{path.name}"
        receipt = check_receipt(path.read_bytes(), where)
        if path.stem != receipt.receipt_id:
            raise FormatError(f"{where}: holds receipt {receipt.receipt_id}, not {path.stem}")
        receipts.append(receipt)
    return receipts
