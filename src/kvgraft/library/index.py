"""A persistent index of what a local store's grafts hold, so the library opens without reading every manifest.

The graft directories are the truth; the index (`<store>/index.json`) is derived from them. Every open reconciles
the two with one directory listing: grafts missing from the index (a crash between writing a graft and updating
the index) are read and added, entries whose graft is gone are dropped, and an unreadable or lost index is
rebuilt from the manifests. Writes are atomic (temp file, fsync, rename), so the index is never half-written.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgraft.format.graft_format import Manifest
from kvgraft.store.local import LocalStore

INDEX_NAME = "index.json"
INDEX_VERSION = 2
SUMMARY_CHARS = 2000
"""the most characters of a graft's metadata summary the index keeps for retrieval"""


@dataclass(frozen=True)
class IndexEntry:
    id: str
    tokens: int
    aligned_tokens: int
    bytes: int
    model_name: str
    kind: str | None = None
    title: str | None = None
    prompt_tokens_sha256: str | None = None
    problems: list[dict[str, str]] = field(default_factory=list)
    """{"id", "problem_sha256"[, "text"]} for each problem whose verified solution the graft holds"""
    summary: str | None = None
    """metadata["summary"] (its first SUMMARY_CHARS characters): what a graft that is not a block is found by"""

    def retrieval_texts(self) -> list[tuple[str, str]]:
        """(label, text) pairs a query is matched against: a block's problems, else the summary, else the title."""
        if self.kind == "block":
            return [(p["id"], p.get("text", "")) for p in self.problems]
        if self.summary:
            return [("summary", self.summary)]
        return [("title", str(self.title))] if self.title else []

    @classmethod
    def of(cls, manifest: Manifest, size: int) -> IndexEntry:
        meta = manifest.metadata
        problems = [
            {k: str(v) for k, v in p.items() if k in ("id", "problem_sha256", "text")} for p in meta.get("problems", [])
        ]
        if meta.get("kind") == "replay":
            problems = [{"id": str(meta["problem_id"]), "problem_sha256": str(meta["problem_sha256"])}]
        summary = meta.get("summary")
        return cls(
            id=manifest.id,
            tokens=len(manifest.tokens),
            aligned_tokens=manifest.aligned_tokens,
            bytes=size,
            model_name=manifest.model_name,
            kind=meta.get("kind"),
            title=meta.get("title"),
            prompt_tokens_sha256=meta.get("prompt_tokens_sha256"),
            problems=problems,
            summary=str(summary)[:SUMMARY_CHARS] if summary else None,
        )


def load_index(store: LocalStore) -> dict[str, IndexEntry]:
    """The index of `store`, reconciled with its graft directories (and saved again when that changed anything)."""
    stored = _read(store)
    present = set(store.ids())
    entries = {graft_id: entry for graft_id, entry in (stored or {}).items() if graft_id in present}
    for graft_id in sorted(present - set(entries)):
        entries[graft_id] = IndexEntry.of(store.manifest(graft_id), store.size_bytes(graft_id))
    if stored is None or set(stored) != set(entries):
        _write(store, entries)
    return entries


def _read(store: LocalStore) -> dict[str, IndexEntry] | None:
    path = store.root / INDEX_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("index_version") != INDEX_VERSION:
            return None
        return {row["id"]: IndexEntry(**row) for row in data["grafts"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # lost or damaged: rebuilt from the manifests


def _write(store: LocalStore, entries: dict[str, IndexEntry]) -> None:
    if not store.root.is_dir():
        return  # an empty store that does not exist yet has nothing to index
    payload: dict[str, Any] = {
        "index_version": INDEX_VERSION,
        "grafts": [asdict(entries[k]) for k in sorted(entries)],
    }
    try:
        fd, tmp = tempfile.mkstemp(prefix="index-", suffix=".json", dir=store.root)
    except OSError:
        return  # a read-only store still works, from the manifests
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, ensure_ascii=False)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, store.root / INDEX_NAME)


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


def store_stats(store: LocalStore) -> StoreStats:
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
