"""A RAM tier in front of any store: restored grafts kept in an LRU bounded in bytes.

Reads that hit the cache skip the disk and the hash check (the bytes were checked when they entered); the bound
is on tensor bytes, so resident memory stays flat however large the library behind it grows. `prefetch` loads a
graft that is likely to be asked for next (the runner-up of a retrieval, the next block of a chain) on a background
thread, so that its later `get` is a RAM hit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from kvgraft.store.base import GraftStore, StoredGraft, StoreTier


def stored_bytes(graft: StoredGraft) -> int:
    return sum(t.numel() * t.element_size() for t in graft.tensors.values())


class CachedStore(StoreTier):
    """A tier implementing `GraftStore` over `inner`, with `get` served from an LRU of at most `max_bytes`."""

    def __init__(self, inner: GraftStore, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        super().__init__(inner)
        self.max_bytes = max_bytes
        self._lru: OrderedDict[str, tuple[StoredGraft, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, Future[StoredGraft]] = {}
        self._prefetcher: ThreadPoolExecutor | None = None
        self.resident_bytes = 0
        self.hits = 0
        self.misses = 0
        self.prefetched = 0

    def get(self, graft_id: str) -> StoredGraft:
        full = self.inner.resolve(graft_id)
        with self._lock:
            cached = self._lru.get(full)
            if cached is not None:
                self._lru.move_to_end(full)
                self.hits += 1
                return cached[0]
            loading = self._loading.get(full)
        if loading is not None:  # a prefetch of it is under way: wait for it rather than read it twice
            graft = loading.result()
            with self._lock:
                self.hits += 1
            return graft
        with self._lock:
            self.misses += 1
        return self._load(full)

    def _load(self, full: str) -> StoredGraft:
        graft = self.inner.get(full)
        size = stored_bytes(graft)
        with self._lock:
            if size <= self.max_bytes and full not in self._lru:
                self._lru[full] = (graft, size)
                self.resident_bytes += size
                while self.resident_bytes > self.max_bytes:
                    _, (_, evicted) = self._lru.popitem(last=False)
                    self.resident_bytes -= evicted
        return graft

    def prefetch(self, graft_id: str) -> bool:
        """Start loading a graft into the cache in the background; False when it is cached or loading already."""
        return self.start_prefetch(graft_id) is not None

    def start_prefetch(self, graft_id: str) -> Future[StoredGraft] | None:
        """`prefetch`, returning the load's future (None when it is cached or loading already).

        Errors (a corrupted graft, say) surface when the graft is asked for, not here.
        """
        full = self.inner.resolve(graft_id)
        with self._lock:
            if full in self._lru or full in self._loading:
                return None
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgraft-prefetch")
            future = self._prefetcher.submit(self._load, full)
            self._loading[full] = future
            self.prefetched += 1

        def done(_: Future[StoredGraft]) -> None:
            with self._lock:
                self._loading.pop(full, None)

        future.add_done_callback(done)
        return future

    def cached_ids(self) -> list[str]:
        """Ids in the cache, least recently used first."""
        with self._lock:
            return list(self._lru)

    def delete(self, graft_id: str) -> None:
        full = self.inner.resolve(graft_id)
        with self._lock:
            entry = self._lru.pop(full, None)
            if entry is not None:
                self.resident_bytes -= entry[1]
        self.inner.delete(full)
