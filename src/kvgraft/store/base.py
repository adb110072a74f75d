"""The interface every graft store implements: a local directory (`LocalStore`), a RAM tier in front of any store
(`CachedStore`), and the remote stores to come. Callers use only this interface, never a concrete class."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvgraft.core.errors import FormatError, IntegrityError, NotFoundError, StoreError
from kvgraft.core.hashing import BlockKey, Digest, GraftId, Sha256Hex
from kvgraft.format.manifest import BlockRef, Manifest

GC_GRACE_S = 3600.0
"""Unreferenced blocks younger than this are kept by gc: a build may be about to name them."""
_HEX = re.compile(r"[0-9a-f]{1,64}")  # used with fullmatch
_KEY_TEXT = re.compile(rb"[0-9a-f]{64}")
_SIDECAR = re.compile(r"(?:(?:receipts|signatures)/)?[A-Za-z0-9][A-Za-z0-9._-]*")  # used with fullmatch
RECEIPTS_DIR = "receipts"
"""Where a store keeps the receipts of served generations, as sidecars `receipts/<receipt id>.json`."""
SIGNATURES_DIR = "signatures"
"""Where a store keeps writers' signatures of grafts, as sidecars `signatures/<name>`."""


@dataclass(frozen=True)
class StoredGraft:
    """A graft read back from a store, every tensor already checked against its manifest hash."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    """Per layer `layers.<i>.key` / `layers.<i>.value` over all aligned positions, [1, kv_heads, aligned, head_dim],
    plus `next_token_logits` [1, vocab] when every token has KV."""


@dataclass(frozen=True)
class GcReport:
    """What `gc` did."""

    removed: int
    """unreferenced blocks removed"""
    freed_bytes: int
    kept_young: int
    """unreferenced blocks kept because they are younger than the grace period (a build may be about to name them)"""

    def to_json(self) -> dict[str, int]:
        return {"removed_blocks": self.removed, "freed_bytes": self.freed_bytes, "kept_young_blocks": self.kept_young}


class GraftStore(Protocol):
    """Content-addressed grafts and their shared KV blocks.

    Every read is checked against the hashes the manifest records; a store never returns bytes it has not checked
    (or, for a RAM tier, bytes that were checked when they entered it).
    """

    @property
    def location(self) -> str:
        """Where the store lives, for messages (a directory, a URL)."""
        ...

    @property
    def directory(self) -> Path | None:
        """The local directory the store lives in, where derived files (receipts) may be kept beside it; None for a
        store without one."""
        ...

    def put(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        blocks: dict[BlockKey, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[GraftId, bool]:
        """Store a graft atomically with those of its blocks the store lacks.

        Args:
            manifest: The graft's manifest; every block it lists must be in `blocks` or already stored.
            tensors: The graft's own tensors (`next_token_logits`, [1, vocab], when every token has KV).
            blocks: Block tensors by key, each `layers.<i>.key` / `.value` of [1, kv_heads, C, head_dim].

        Returns:
            The graft id, and whether it was created (storing the same content again creates nothing).
        """
        ...

    def has_block(self, key: BlockKey) -> bool:
        """Whether the block with this chained key is stored."""
        ...

    def read_block(
        self,
        key: BlockKey,
        block: BlockRef | None = None,
        shapes: dict[str, list[int]] | None = None,
        dtype: str | None = None,
    ) -> tuple[BlockRef, dict[str, torch.Tensor]]:
        """One block's tensors, checked.

        Args:
            key: The block's chained key.
            block: The manifest's entry for it; None when no manifest names the block yet (a build reusing it),
                and the bytes are checked against the digest the block declares.
            shapes: Tensor names and shapes the block must hold; None accepts the block's own.
            dtype: The torch dtype name every tensor must have; None accepts the block's own.

        Returns:
            The block's reference (key and digest) and its tensors, [1, kv_heads, C, head_dim] each.
        """
        ...

    def resolve(self, id_or_prefix: str) -> GraftId:
        """The one full id starting with `id_or_prefix`; NotFoundError when none or several match."""
        ...

    def manifest(self, graft_id: str) -> Manifest:
        """Read and validate one manifest (no tensor is read)."""
        ...

    def get(self, graft_id: str) -> StoredGraft:
        """Read a graft, checking every tensor's SHA-256 before returning it."""
        ...

    def prefetch(self, graft_id: str) -> bool:
        """Start loading a graft likely to be asked for next into a faster tier, in the background.

        Returns:
            True when a load started; False when the store has no faster tier or the graft is there already.
        """
        ...

    def ids(self) -> list[GraftId]:
        """Every graft id, sorted."""
        ...

    def change_token(self) -> Hashable | None:
        """A value that changes whenever a graft is added or removed, by any process; None when the store cannot
        tell cheaply (readers then refresh on a timer)."""
        ...

    def delete(self, graft_id: str) -> None:
        """Remove a graft and those of its blocks no other graft names."""
        ...

    def tensors_path(self, graft_id: str) -> str:
        """Where the tensors of a graft can be read directly (a path or URL)."""
        ...

    def size_bytes(self, graft_id: str) -> int:
        """Bytes the graft takes on its own: its own files plus every block it names, shared or not."""
        ...

    def disk_bytes(self) -> int:
        """Bytes the store takes, each shared block counted once."""
        ...

    def gc(self, grace_s: float = GC_GRACE_S) -> GcReport:
        """Remove blocks no graft names that are older than `grace_s`, and count those it kept as younger."""
        ...

    def read_sidecar(self, name: str) -> bytes | None:
        """A small file kept beside the grafts (the library index, `receipts/<id>.json`, `signatures/<name>`), or None
        when there is none.

        Args:
            name: a file name, or `receipts/` or `signatures/` and a file name (`check_sidecar_name`).
        """
        ...

    def write_sidecar(self, name: str, data: bytes) -> None:
        """Replace a sidecar atomically; a store that cannot keep one (read-only) silently keeps none: the index is
        always rebuilt from the grafts, and a receipt is also in the reply that carried it.

        Args:
            name: as in `read_sidecar`.
            data: the file's bytes.
        """
        ...

    def own_tensors(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """A graft's own tensors, without its blocks, each checked against the manifest's hash.

        Args:
            manifest: The graft's manifest (as `manifest` returned it).

        Returns:
            `next_token_logits` [1, vocab] when every token has KV; nothing otherwise.
        """
        ...


@dataclass(frozen=True)
class ManifestScan:
    """Every graft's manifest, read one by one: what a command walking the whole store works from."""

    manifests: dict[GraftId, Manifest]
    """the readable ones, by id"""
    damaged: dict[GraftId, str]
    """the unreadable ones (truncated, altered, unparsable), by id, with the error that says why"""


def scan_manifests(store: GraftStore) -> ManifestScan:
    """Read every graft's manifest, carrying on past damaged ones; a graft removed since the listing is left out.

    Raises:
        StoreError: the store itself cannot be read (a damaged graft is reported, not raised).
    """
    manifests: dict[GraftId, Manifest] = {}
    damaged: dict[GraftId, str] = {}
    for graft_id in store.ids():
        try:
            manifests[graft_id] = store.manifest(graft_id)
        except NotFoundError:
            continue  # removed by another process between the listing and this read
        except (FormatError, IntegrityError) as exc:
            damaged[graft_id] = str(exc)
    return ManifestScan(manifests, damaged)


def keys_named_in(raw: bytes) -> set[str]:
    """Every 64-hex-digit string in a damaged manifest's bytes: the blocks it may still name. A superset (graft and
    tensor digests match too), which is what keeping blocks conservatively needs."""
    return {match.decode() for match in _KEY_TEXT.findall(raw)}


def manifest_keys(store: GraftStore, graft_id: str, raw: Callable[[], bytes | None]) -> set[str]:
    """The block keys a graft names: from its manifest, or, when that is damaged, every key its bytes may name.

    Args:
        store: The store.
        graft_id: A full graft id.
        raw: Reads the manifest's bytes (None when gone).

    Returns:
        The keys; empty when the graft is gone.
    """
    try:
        return {ref.key for ref in store.manifest(graft_id).blocks}
    except NotFoundError:
        return set()
    except (FormatError, IntegrityError):
        data = raw()
        return keys_named_in(data) if data is not None else set()


def check_sidecar_name(name: str) -> str:
    """A sidecar name, checked: one plain file name, or `receipts/` or `signatures/` and one (never a path that climbs
    out).

    Returns:
        The name.

    Raises:
        StoreError: any other name (a caller's mistake, not a user's).
    """
    if not _SIDECAR.fullmatch(name):
        raise StoreError(f"not a sidecar name: {name!r}")
    return name


def resolve_id(
    id_or_prefix: str, location: str, has_graft: Callable[[str], bool], ids: Callable[[], list[GraftId]]
) -> GraftId:
    """The one full graft id starting with `id_or_prefix`, for any store.

    Args:
        id_or_prefix: A full id or a unique prefix of one (hex digits).
        location: The store's location, for messages.
        has_graft: Whether the graft with this full id exists (one cheap check: a stat, a HEAD).
        ids: Every graft id of the store (a listing; used only for prefixes).

    Returns:
        The full id.

    Raises:
        NotFoundError: not hex, no graft, or a prefix shared by several grafts.
    """
    prefix = id_or_prefix.strip().lower()
    if not _HEX.fullmatch(prefix):
        raise NotFoundError(f"{id_or_prefix!r} is not a graft id (hex digits expected)")
    if len(prefix) == 64:  # a full id: one check, not a listing of the whole store
        if has_graft(prefix):
            return GraftId(Sha256Hex(prefix))
        raise NotFoundError(f"no graft {id_or_prefix} in store {location}")
    matches = [i for i in ids() if i.startswith(prefix)]
    if not matches:
        raise NotFoundError(f"no graft {id_or_prefix} in store {location}")
    if len(matches) > 1:
        raise NotFoundError(f"graft id prefix {id_or_prefix} is ambiguous ({len(matches)} grafts); give more digits")
    return matches[0]


def stored_block_digest(
    ref: BlockRef,
    given: dict[str, torch.Tensor] | None,
    declared: Callable[[], str | None],
    checked: Callable[[], Digest],
) -> str | None:
    """The digest of a block a put finds already stored, for any store; raises if it differs from the graft's.

    A block the writer does not give was read and hash-checked when the graft was built, so its declared digest
    suffices; a block the writer computed again is checked in full, and a damaged stored copy is then replaced by
    the writer's (which repairs every graft naming it).

    Args:
        ref: The graft's entry for the block.
        given: The writer's tensors for the block, or None when it reuses the stored one.
        declared: Reads the digest the stored block declares in its header (not its bytes).
        checked: Reads and hash-checks the stored block's bytes, returning their digest.

    Returns:
        The stored digest (equal to `ref.sha256`), or None when the stored copy is damaged and `given` replaces it.

    Raises:
        IntegrityError: the store holds other bytes under the same key, or a reused block is damaged.
        FormatError: a reused block is unreadable.
    """
    try:
        stored = declared() if given is None else checked()
    except (IntegrityError, FormatError):
        if given is None:
            raise
        return None
    if stored != ref.sha256:
        raise IntegrityError(
            f"block {ref.key[:12]} is stored with other bytes ({str(stored)[:12]}, this graft has {ref.sha256[:12]}): "
            "the same tokens under the same fingerprint gave different KV"
        )
    return stored


class StoreTier:
    """A tier in front of another store (`inner`): every member is `inner`'s until a subclass overrides it.

    The RAM tier (`CachedStore`) and the Redis tier (`RedisTier`) override the reads they speed up.
    """

    def __init__(self, inner: GraftStore) -> None:
        self.inner = inner

    @property
    def location(self) -> str:
        return self.inner.location

    @property
    def directory(self) -> Path | None:
        return self.inner.directory

    def put(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        blocks: dict[BlockKey, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[GraftId, bool]:
        return self.inner.put(manifest, tensors, blocks)

    def has_block(self, key: BlockKey) -> bool:
        return self.inner.has_block(key)

    def read_block(
        self,
        key: BlockKey,
        block: BlockRef | None = None,
        shapes: dict[str, list[int]] | None = None,
        dtype: str | None = None,
    ) -> tuple[BlockRef, dict[str, torch.Tensor]]:
        return self.inner.read_block(key, block, shapes, dtype)

    def resolve(self, id_or_prefix: str) -> GraftId:
        return self.inner.resolve(id_or_prefix)

    def manifest(self, graft_id: str) -> Manifest:
        return self.inner.manifest(graft_id)

    def get(self, graft_id: str) -> StoredGraft:
        return self.inner.get(graft_id)

    def prefetch(self, graft_id: str) -> bool:
        return self.inner.prefetch(graft_id)

    def ids(self) -> list[GraftId]:
        return self.inner.ids()

    def change_token(self) -> Hashable | None:
        return self.inner.change_token()

    def delete(self, graft_id: str) -> None:
        self.inner.delete(graft_id)

    def tensors_path(self, graft_id: str) -> str:
        return self.inner.tensors_path(graft_id)

    def size_bytes(self, graft_id: str) -> int:
        return self.inner.size_bytes(graft_id)

    def disk_bytes(self) -> int:
        return self.inner.disk_bytes()

    def gc(self, grace_s: float = GC_GRACE_S) -> GcReport:
        return self.inner.gc(grace_s)

    def read_sidecar(self, name: str) -> bytes | None:
        return self.inner.read_sidecar(name)

    def write_sidecar(self, name: str, data: bytes) -> None:
        self.inner.write_sidecar(name, data)

    def own_tensors(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        return self.inner.own_tensors(manifest)
