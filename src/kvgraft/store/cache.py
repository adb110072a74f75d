"""A RAM tier in front of any store: restored grafts kept in an LRU bounded in bytes.

Reads that hit the cache skip the disk and the hash check (the bytes were checked when they entered); the bound
is on tensor bytes, so resident memory stays flat however large the library behind it grows.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvgraft.graft_format import Manifest
from kvgraft.hashing import Sha256Hex
from kvgraft.store.base import GraftStore, StoredGraft


def stored_bytes(graft: StoredGraft) -> int:
    return sum(t.numel() * t.element_size() for t in graft.tensors.values())


class CachedStore:
    """Implements `GraftStore` by delegating to `inner`, with `get` served from an LRU of at most `max_bytes`."""

    def __init__(self, inner: GraftStore, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.inner = inner
        self.max_bytes = max_bytes
        self._lru: OrderedDict[str, tuple[StoredGraft, int]] = OrderedDict()
        self.resident_bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def location(self) -> str:
        return self.inner.location

    def get(self, graft_id: str) -> StoredGraft:
        full = self.inner.resolve(graft_id)
        cached = self._lru.get(full)
        if cached is not None:
            self._lru.move_to_end(full)
            self.hits += 1
            return cached[0]
        self.misses += 1
        graft = self.inner.get(full)
        size = stored_bytes(graft)
        if size <= self.max_bytes:
            self._lru[full] = (graft, size)
            self.resident_bytes += size
            while self.resident_bytes > self.max_bytes:
                _, (_, evicted) = self._lru.popitem(last=False)
                self.resident_bytes -= evicted
        return graft

    def cached_ids(self) -> list[str]:
        """Ids in the cache, least recently used first."""
        return list(self._lru)

    def put(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> tuple[Sha256Hex, bool]:
        return self.inner.put(manifest, tensors)

    def resolve(self, id_or_prefix: str) -> Sha256Hex:
        return self.inner.resolve(id_or_prefix)

    def manifest(self, graft_id: str) -> Manifest:
        return self.inner.manifest(graft_id)

    def ids(self) -> list[Sha256Hex]:
        return self.inner.ids()

    def delete(self, graft_id: str) -> None:
        full = self.inner.resolve(graft_id)
        entry = self._lru.pop(full, None)
        if entry is not None:
            self.resident_bytes -= entry[1]
        self.inner.delete(full)

    def tensors_path(self, graft_id: str) -> str:
        return self.inner.tensors_path(graft_id)

    def size_bytes(self, graft_id: str) -> int:
        return self.inner.size_bytes(graft_id)
