"""The graft library seen from a query: replay grafts found by prompt hash, context blocks found by BM25.

Grafts join the library through their metadata (written by harvest):
- replay: {"kind": "replay", "problem_id", "problem_sha256", "prompt_tokens_sha256", "answer", "cost": {...}}
- block:  {"kind": "block", "problems": [{"id", "problem_sha256", "text"}, ...]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import bm25s

from kvgraft.hashing import sha256_token_ids
from kvgraft.store import GraftStore, LocalStore
from kvgraft.store.index import IndexEntry, load_index

_WORD = re.compile(r"\w+")
# Numbers matter in these problems, so single characters count as tokens and no stop words are dropped.
_TOKEN_PATTERN = r"(?u)\b\w+\b"


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def jaccard(a: str, b: str) -> float:
    """Word-set overlap in [0, 1]: 1.0 when two problems use the same words (the gate's match score)."""
    wa, wb = words(a), words(b)
    return len(wa & wb) / len(wa | wb) if wa or wb else 0.0


@dataclass(frozen=True)
class BlockHit:
    graft_id: str
    bm25: float
    match: float
    """Jaccard overlap between the query and the block's best-matching problem, in [0, 1]."""
    problem_id: str


@dataclass
class Library:
    replay_by_prompt: dict[str, str] = field(default_factory=dict)
    replay_problems: dict[str, str] = field(default_factory=dict)
    """problem_sha256 -> replay graft id"""
    block_entries: list[tuple[str, str, str]] = field(default_factory=list)
    """(graft id, problem id, problem text), one per problem held by a block"""
    _index: bm25s.BM25 | None = None

    @classmethod
    def from_store(cls, store: GraftStore) -> Library:
        """The library of a store, from its persistent index (local stores) or its manifests (others)."""
        if isinstance(store, LocalStore):
            entries = list(load_index(store).values())
        else:
            entries = [IndexEntry.of(store.manifest(i), store.size_bytes(i)) for i in store.ids()]
        library = cls()
        for entry in entries:
            if entry.kind == "replay" and entry.prompt_tokens_sha256 and entry.problems:
                library.replay_by_prompt[entry.prompt_tokens_sha256] = entry.id
                library.replay_problems[entry.problems[0]["problem_sha256"]] = entry.id
            elif entry.kind == "block":
                for problem in entry.problems:
                    library.block_entries.append((entry.id, problem["id"], problem.get("text", "")))
        return library

    def find_replay(self, prompt_tokens: list[int]) -> str | None:
        """The replay graft whose prompt tokens equal these, found by their SHA-256."""
        return self.replay_by_prompt.get(sha256_token_ids(prompt_tokens))

    def holds(self, problem_sha256: str) -> bool:
        """Whether a verified solution of this problem is in the library (the problem is "seen")."""
        return problem_sha256 in self.replay_problems

    def search_blocks(self, query: str, k: int = 3) -> list[BlockHit]:
        """The best k blocks for a query, each scored by its best-matching problem (BM25, then word overlap)."""
        if not self.block_entries:
            return []
        if self._index is None:
            self._index = bm25s.BM25()
            corpus = bm25s.tokenize(
                [text for _, _, text in self.block_entries],
                stopwords=None,
                token_pattern=_TOKEN_PATTERN,
                show_progress=False,
            )
            self._index.index(corpus, show_progress=False)
        query_tokens = bm25s.tokenize([query], stopwords=None, token_pattern=_TOKEN_PATTERN, show_progress=False)
        n = min(len(self.block_entries), max(k * 8, 16))
        docs, scores = self._index.retrieve(query_tokens, k=n, show_progress=False)
        best: dict[str, BlockHit] = {}
        for doc, score in zip(docs[0].tolist(), scores[0].tolist(), strict=True):
            graft_id, problem_id, text = self.block_entries[doc]
            if graft_id not in best:
                best[graft_id] = BlockHit(graft_id, float(score), jaccard(query, text), problem_id)
        return sorted(best.values(), key=lambda h: (-h.bm25, h.graft_id))[:k]
