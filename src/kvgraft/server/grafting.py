"""Which graft a request runs on: the one it names, the library's best graft for its prompt, or none.

Runs on the model worker (it reads the store and the retrieval index, which the worker also writes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgraft.core.errors import KvgraftError
from kvgraft.engine.engine import Engine
from kvgraft.format.manifest import Manifest
from kvgraft.library.library import Library
from kvgraft.library.retrieval import Retriever, make_retriever
from kvgraft.models.loading import max_positions
from kvgraft.store import GraftStore


@dataclass(frozen=True)
class GraftChoice:
    """How a request wants grafting done (the `kvgraft` field of its body)."""

    grafts: tuple[str, ...] = ()
    approximate: bool = False
    retrieve: bool = True
    min_score: float = 0.0
    min_match: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """One graft retrieval proposed for a request, and whether it was used (the reply's `retrieval` list)."""

    graft_id: str
    score: float
    """The retriever's score of the graft's best-matching text (BM25 unless the server runs a dense retriever)."""
    match: float
    """Word overlap (Jaccard) between the query and that text, in [0, 1]."""
    label: str
    """Which text matched: a block's entry id, or "summary" / "title"."""
    used: bool
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "graft_id": self.graft_id,
            "score": self.score,
            "match": self.match,
            "label": self.label,
            "used": self.used,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class GraftPlan:
    """What a request runs on: the graft(s) it named, the one retrieval chose, or none."""

    graft_id: str | None
    source: str | None
    """"request" (named by the request), "retrieval" (the library's best graft), or None (a bare run)."""
    manifest: Manifest | None
    retrieval: list[Candidate] = field(default_factory=list)
    searched: bool = False
    """Whether the library was searched (so a bare run after a search is a retrieval miss)."""
    named: tuple[Manifest, ...] = ()
    """Every graft the request named, in order (several: a chain, or an approximate composition)."""


@dataclass(frozen=True)
class LibrarySnapshot:
    """The retrieval library of the store as it was at one moment."""

    library: Library


class LibraryView:
    """The store's retrieval library, rebuilt only when the store changed: rebuilding re-indexes every text, far too
    slow to do per request on a large library. A store's `change_token` changes whenever a graft is added or
    removed, by this server or any other process; a store that cannot tell is rebuilt at most every `refresh_s`.
    The server's own writes invalidate at once."""

    def __init__(
        self,
        store: GraftStore,
        refresh_s: float,
        retriever: Retriever | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._retriever = retriever if retriever is not None else make_retriever()
        self._clock = clock
        self._snapshot: LibrarySnapshot | None = None
        self._signature: object = None
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        """Rebuild on the next `get` (the server just changed the store)."""
        with self._lock:
            self._snapshot = None

    def _current_signature(self) -> object:
        token = self._store.change_token()
        return token if token is not None else ("clock", int(self._clock() // self._refresh_s))

    def get(self) -> LibrarySnapshot:
        """Returns: the library, rebuilt first if the store changed since it was built."""
        with self._lock:
            signature = self._current_signature()
            if self._snapshot is None or signature != self._signature:
                # `empty()` shares a dense retriever's loaded model instead of loading it again.
                self._snapshot = LibrarySnapshot(Library.from_store(self._store, self._retriever.empty()))
                self._signature = signature
            return self._snapshot


def plan_grafts(
    engine: Engine,
    library: Callable[[], LibrarySnapshot],
    choice: GraftChoice,
    query: str,
    prompt: str,
    max_new_tokens: int,
    candidates: int,
) -> GraftPlan:
    """Resolve the named graft (NotFoundError if unknown), else retrieve, else bare.

    A retrieved graft is used only when its score is positive and reaches `min_score`, its word overlap reaches
    `min_match`, it was built by this model under this schedule (and environment, unless mismatches are
    allowed), and it leaves room for the prompt and the new tokens; every candidate is reported, with the reason
    it was skipped.

    Args:
        engine: the engine (its store, model and fingerprint).
        library: gives the current retrieval library (`LibraryView.get`).
        choice: what the request asked for.
        query: what retrieval searches with.
        prompt: the prompt text, to count the positions it needs.
        max_new_tokens: the tokens the request may generate.
        candidates: how many retrieval hits to consider.

    Returns:
        The plan, with every retrieval candidate reported.

    Raises:
        NotFoundError: a named graft is not in the store.
    """
    if choice.grafts:
        named = tuple(engine.store.manifest(g) for g in choice.grafts)
        return GraftPlan(named[-1].id, "request", named[-1], named=named)
    if not choice.retrieve or not query.strip():
        return GraftPlan(None, None, None)
    snapshot = library()
    hits = snapshot.library.search(query, k=candidates)
    limit = max_positions(engine.model)
    needed = len(engine.encode_continuation(prompt)) + max_new_tokens
    chosen: Manifest | None = None
    report: list[Candidate] = []
    for hit in hits:
        reason: str | None = None
        manifest: Manifest | None = None
        if chosen is not None:
            reason = "a better graft was used"
        elif hit.score <= 0 or hit.score < choice.min_score:
            reason = f"score below min_score {choice.min_score}" if hit.score > 0 else "score is not positive"
        elif hit.match < choice.min_match:
            reason = f"match below min_match {choice.min_match}"
        else:
            try:
                manifest = engine.store.manifest(hit.graft_id)
                engine.check_graft(manifest.fingerprint)
            except KvgraftError as exc:
                reason = f"not usable by this model: {type(exc).__name__}"
            else:
                if limit is not None and len(manifest.tokens) + needed > limit:
                    reason = "graft, prompt and max_tokens exceed the model's positions"
        used = reason is None and manifest is not None
        if used:
            chosen = manifest
        report.append(Candidate(hit.graft_id, hit.score, hit.match, hit.label, used, reason))
    if chosen is None:
        return GraftPlan(None, None, None, report, searched=True)
    return GraftPlan(chosen.id, "retrieval", chosen, report, searched=True)
