"""The interface every graft store implements (local directory now; Redis or S3 can follow)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvgraft.core.hashing import Sha256Hex
from kvgraft.format.graft_format import BlockRef, Manifest


@dataclass(frozen=True)
class StoredGraft:
    """A graft read back from a store, every tensor already checked against its manifest hash."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]


class GraftStore(Protocol):
    @property
    def location(self) -> str:
        """Where the store lives, for messages (a directory, a URL)."""
        ...

    def put(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        blocks: dict[Sha256Hex, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[Sha256Hex, bool]:
        """Store a graft atomically with those of its blocks (by key) the store lacks; returns (id, created).
        Storing the same content again creates nothing."""
        ...

    def has_block(self, key: str) -> bool:
        """Whether the block with this chained key is stored."""
        ...

    def read_block(
        self, key: Sha256Hex, block: BlockRef | None = None, shapes: dict[str, list[int]] | None = None
    ) -> tuple[BlockRef, dict[str, torch.Tensor]]:
        """One block's tensors, checked against `block` (or, when None, the digest the block declares)."""
        ...

    def resolve(self, id_or_prefix: str) -> Sha256Hex:
        """The one full id starting with `id_or_prefix`; NotFoundError when none or several match."""
        ...

    def manifest(self, graft_id: str) -> Manifest:
        """Read and validate one manifest (no tensor is read)."""
        ...

    def get(self, graft_id: str) -> StoredGraft:
        """Read a graft, checking every tensor's SHA-256 before returning it."""
        ...

    def ids(self) -> list[Sha256Hex]: ...

    def delete(self, graft_id: str) -> None: ...

    def tensors_path(self, graft_id: str) -> str:
        """Where the tensors of a graft can be read directly (a path or URL)."""
        ...

    def size_bytes(self, graft_id: str) -> int: ...
