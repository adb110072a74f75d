"""A persistent index of what a store's grafts hold, so the library opens without reading every manifest.

The grafts are the truth; the index (the store's `index.json` sidecar, `<store>/index.json` for a local store) is
derived from them. Every open reconciles the two with one listing of the store's ids: grafts missing from the index
(a crash between writing a graft and updating the index) are read and added, entries whose graft is gone are
dropped, and an unreadable or lost index is rebuilt from the manifests. The index records the SHA-256 of its rows,
so a damaged index (a flipped byte in a summary retrieval ranks by) is rebuilt too, never trusted. The store writes
the sidecar atomically, so the index is never half-written. A graft whose manifest is damaged is left out of the
index (it cannot be used) and reported by `scan_index`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgraft.core.errors import FormatError, IntegrityError, NotFoundError
from kvgraft.format.manifest import Manifest
from kvgraft.format.metadata import GraftKind, GraftMetadata, ProblemRef
from kvgraft.store.base import GraftStore

INDEX_NAME = "index.json"
INDEX_VERSION = 3


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
    prompt_format: str | None = None
    """a replay's prompt format ("plain", "chat"); None for other grafts (and in rows written before it existed)"""

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
            prompt_format=meta.prompt_format,
        )


@dataclass(frozen=True)
class IndexScan:
    """The index of a store, reconciled with its grafts, and the grafts left out of it as damaged."""

    entries: dict[str, IndexEntry]
    """one entry per usable graft, by id"""
    damaged: dict[str, str]
    """grafts not yet indexed whose manifest cannot be read, by id, with the error that says why"""


def load_index(store: GraftStore) -> dict[str, IndexEntry]:
    """The index of `store`, reconciled with its grafts (and saved again when that changed anything).

    Args:
        store: Any graft store; one that keeps no sidecar has its index rebuilt from the manifests each time.

    Returns:
        One entry per usable graft, by id (damaged ones are left out: `scan_index` reports them).
    """
    return scan_index(store).entries


def scan_index(store: GraftStore) -> IndexScan:
    """`load_index`, also reporting the grafts left out because their manifest is damaged.

    A graft removed by another process while this runs is left out; a damaged one is left out and reported.
    """
    stored = _read(store)
    present = set(store.ids())
    entries = {graft_id: entry for graft_id, entry in (stored or {}).items() if graft_id in present}
    damaged: dict[str, str] = {}
    for graft_id in sorted(present - set(entries)):
        try:
            entries[graft_id] = IndexEntry.of(store.manifest(graft_id), store.size_bytes(graft_id))
        except NotFoundError:
            continue  # removed since the listing
        except (FormatError, IntegrityError) as exc:
            damaged[graft_id] = str(exc)
    if stored is None or set(stored) != set(entries):
        _write(store, entries)
    return IndexScan(entries, damaged)


def _rows_sha256(rows: Any) -> str:
    """SHA-256 of the rows in one canonical JSON form (sorted keys, no spaces), whatever the file's layout."""
    canonical = json.dumps(rows, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _read(store: GraftStore) -> dict[str, IndexEntry] | None:
    raw = store.read_sidecar(INDEX_NAME)
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        if data.get("index_version") != INDEX_VERSION or data.get("grafts_sha256") != _rows_sha256(data["grafts"]):
            return None  # an older layout, or damaged: rebuilt from the manifests
        return {row["id"]: IndexEntry(**row) for row in data["grafts"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # lost or damaged: rebuilt from the manifests


def _write(store: GraftStore, entries: dict[str, IndexEntry]) -> None:
    rows = [asdict(entries[k]) for k in sorted(entries)]
    payload: dict[str, Any] = {"index_version": INDEX_VERSION, "grafts_sha256": _rows_sha256(rows), "grafts": rows}
    store.write_sidecar(INDEX_NAME, json.dumps(payload, ensure_ascii=False).encode("utf-8"))


@dataclass(frozen=True)
class StoreStats:
    grafts: int
    tokens: int
    aligned_tokens: int
    disk_bytes: int
    logical_bytes: int
    damaged_grafts: int = 0
    """grafts the index could not take in because their manifest cannot be read (`kvgraft ls` lists every damaged
    graft; `kvgraft rm` removes one)"""

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
    scan = scan_index(store)
    entries = scan.entries.values()
    return StoreStats(
        grafts=len(entries),
        tokens=sum(e.tokens for e in entries),
        aligned_tokens=sum(e.aligned_tokens for e in entries),
        disk_bytes=store.disk_bytes(),
        logical_bytes=sum(e.bytes for e in entries),
        damaged_grafts=len(scan.damaged),
    )
