"""The interface every graft store implements: a local directory (`LocalStore`), a RAM tier in front of any store
(`CachedStore`), and the remote stores to come. Callers use only this interface, never a concrete class."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvgraft.core.hashing import BlockKey, GraftId
from kvgraft.format.manifest import BlockRef, Manifest

GC_GRACE_S = 3600.0
"""Unreferenced blocks younger than this are kept by gc: a build may be about to name them."""


@dataclass(frozen=True)
class StoredGraft:
    """A graft read back from a store, every tensor already checked against its manifest hash."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    """Per layer `layers.<i>.key` / `layers.<i>.value` over all aligned positions, [1, kv_heads, aligned, head_dim],
    plus `next_token_logits` [1, vocab] when every token has KV."""


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

    def gc(self, grace_s: float = GC_GRACE_S) -> tuple[int, int]:
        """Remove blocks no graft names that are older than `grace_s`; returns (blocks removed, bytes freed)."""
        ...

    def read_sidecar(self, name: str) -> bytes | None:
        """A small derived file kept beside the grafts (the library index), or None when there is none."""
        ...

    def write_sidecar(self, name: str, data: bytes) -> None:
        """Replace a derived file atomically; a store that cannot keep one (read-only) silently keeps none: derived
        data is always rebuilt from the grafts."""
        ...
