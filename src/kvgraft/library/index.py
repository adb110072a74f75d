"""A persistent index of what a store's grafts hold, so the library opens without reading every manifest.

The grafts are the truth; the index (the store's `index.json` sidecar, `<store>/index.json` for a local store) is
derived from them. Every open reconciles the two with one listing of the store's ids: grafts missing from the index
(a crash between writing a graft and updating the index) are read and added, entries whose graft is gone are
dropped, and an unreadable or lost index is rebuilt from the manifests. The store writes the sidecar atomically,
so the index is never half-written.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgraft.format.manifest import Manifest
from kvgraft.format.metadata import GraftKind, GraftMetadata, ProblemRef
from kvgraft.store.base import GraftStore

INDEX_NAME = "index.json"
INDEX_VERSION = 2


@dataclass(frozen=True)
class IndexEntry:
    """One graft as the index records it (one row of index.json, docs/FORMAT.md section 7)."""

    id: str
    tokens: int
    aligned_tokens: int
    bytes: int
    model_name: str
    kind: GraftKind | str | None = None
    """the metadata's "kind": a GraftKind when it names one (a row read back as a string becomes one again)"""
    title: str | None = None
    prompt_tokens_sha256: str | None = None
    problems: list[dict[str, str]] = field(default_factory=list)
    """{"id", "problem_sha256"[, "text"]} for each problem whose verified solution the graft holds"""
    summary: str | None = None
    """metadata["summary"] (its first SUMMARY_CHARS characters): what a graft that is not a block is found by"""

    def __post_init__(self) -> None:
        if isinstance(self.kind, str) and self.kind in {kind.value for kind in GraftKind}:
            object.__setattr__(self, "kind", GraftKind(self.kind))

    @property
    def problem_refs(self) -> tuple[ProblemRef, ...]:
        """The problems, typed (entries that are not well formed are left out)."""
        return tuple(ref for ref in map(ProblemRef.read, self.problems) if ref is not None)

    def retrieval_texts(self) -> list[tuple[str, str]]:
        """The texts a query is matched against.

        Returns:
            (label, text) pairs: a block's problems (labelled by problem id), else its summary, else its title.
        """
        if self.kind is GraftKind.BLOCK:
            return [(ref.id, ref.text or "") for ref in self.problem_refs]
        if self.summary:
            return [("summary", self.summary)]
        return [("title", str(self.title))] if self.title else []

    @classmethod
    def of(cls, manifest: Manifest, size: int) -> IndexEntry:
        """The entry of a graft.

        Args:
            manifest: the graft's manifest; its metadata is read leniently (`GraftMetadata.read`).
            size: the graft's size in bytes (its directory plus every block it names).

        Returns:
            The graft's index entry.
        """
        meta = GraftMetadata.read(manifest.metadata)
        return cls(
            id=manifest.id,
            tokens=len(manifest.tokens),
            aligned_tokens=manifest.aligned_tokens,
            bytes=size,
            model_name=manifest.model_name,
            kind=meta.kind,
            title=meta.title,
            prompt_tokens_sha256=meta.prompt_tokens_sha256,
            problems=[ref.to_json() for ref in meta.problems],
            summary=meta.summary,
        )


def load_index(store: GraftStore) -> dict[str, IndexEntry]:
    """The index of `store`, reconciled with its grafts (and saved again when that changed anything).

    Args:
        store: Any graft store; one that keeps no sidecar has its index rebuilt from the manifests each time.

    Returns:
        One entry per graft, by id.
    """
    stored = _read(store)
    present = set(store.ids())
    entries = {graft_id: entry for graft_id, entry in (stored or {}).items() if graft_id in present}
    for graft_id in sorted(present - set(entries)):
        entries[graft_id] = IndexEntry.of(store.manifest(graft_id), store.size_bytes(graft_id))
    if stored is None or set(stored) != set(entries):
        _write(store, entries)
    return entries


def _read(store: GraftStore) -> dict[str, IndexEntry] | None:
    raw = store.read_sidecar(INDEX_NAME)
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        if data.get("index_version") != INDEX_VERSION:
            return None
        return {row["id"]: IndexEntry(**row) for row in data["grafts"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # lost or damaged: rebuilt from the manifests


def _write(store: GraftStore, entries: dict[str, IndexEntry]) -> None:
    payload: dict[str, Any] = {
        "index_version": INDEX_VERSION,
        "grafts": [asdict(entries[k]) for k in sorted(entries)],
    }
    store.write_sidecar(INDEX_NAME, json.dumps(payload, ensure_ascii=False).encode("utf-8"))


@dataclass(frozen=True)
class StoreStats:
    grafts: int
    tokens: int
    aligned_tokens: int
    disk_bytes: int
    logical_bytes: int

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes over bytes on disk: 1.0 when no block is shared (more when prefixes are stored once; less
        when the store holds blocks no graft names any more, which `kvgraft store gc` removes)."""
        return self.logical_bytes / self.disk_bytes if self.disk_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"dedup_ratio": self.dedup_ratio}


def store_stats(store: GraftStore) -> StoreStats:
    """Logical bytes are what the grafts would take each on its own (every block they name counted for each);
    disk bytes count every graft directory and every block file once."""
    entries = load_index(store).values()
    return StoreStats(
        grafts=len(entries),
        tokens=sum(e.tokens for e in entries),
        aligned_tokens=sum(e.aligned_tokens for e in entries),
        disk_bytes=store.disk_bytes(),
        logical_bytes=sum(e.bytes for e in entries),
    )
