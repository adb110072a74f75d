"""The graft library seen from a query: replay grafts found by prompt or problem hash, any other graft by its texts.

Grafts join the library through their metadata (written by harvest, or given to `Engine.put`; the shapes are in
kvgraft.format.metadata): a replay graft by the hash of its prompt tokens or of its problem's text, a block by its
problems' texts, any other graft by its summary or title.
Texts are matched by a retriever (kvgraft.library.retrieval): BM25 by default, or a local sentence-transformers model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.core.hashing import sha256_token_ids
from kvgraft.core.memory import release_free_memory
from kvgraft.format.metadata import GraftKind
from kvgraft.library.index import IndexEntry, load_index
from kvgraft.library.retrieval import Retriever, make_retriever
from kvgraft.store import GraftStore

_WORD = re.compile(r"\w+")


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def jaccard(a: str, b: str) -> float:
    """Word-set overlap in [0, 1]: 1.0 when two problems use the same words (the gate's match score)."""
    wa, wb = words(a), words(b)
    return len(wa & wb) / len(wa | wb) if wa or wb else 0.0


@dataclass(frozen=True)
class BlockHit:
    graft_id: str
    score: float
    """the retriever's score of the block's best-matching problem (BM25, or cosine similarity when dense)"""
    match: float
    """Jaccard overlap between the query and the block's best-matching problem, in [0, 1] (what the gate reads)"""
    problem_id: str


@dataclass(frozen=True)
class Hit:
    graft_id: str
    score: float
    """the retriever's score of the graft's best-matching text"""
    label: str
    """which text matched: a block's problem id, or "summary" / "title" for any other graft"""
    match: float
    """Jaccard overlap between the query and that text, in [0, 1]"""


Doc = tuple[str, str, str]
"""(graft id, label, text)"""


@dataclass
class Library:
    replay_by_prompt: dict[str, str] = field(default_factory=dict)
    replay_problems: dict[str, str] = field(default_factory=dict)
    """problem_sha256 -> replay graft id"""
    replay_by_format: dict[tuple[str, str], str] = field(default_factory=dict)
    """(prompt format, problem_sha256) -> replay graft id"""
    block_entries: list[Doc] = field(default_factory=list)
    """(graft id, problem id, problem text), one per problem held by a block"""
    other_entries: list[Doc] = field(default_factory=list)
    """(graft id, "summary" or "title", text) for every other graft that has one"""
    retriever: Retriever = field(default_factory=make_retriever)
    """indexed lazily, at the first search: the entries are fixed from then on"""
    _all: tuple[Retriever, list[Doc]] | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_store(cls, store: GraftStore, retriever: Retriever | str | Path | None = None) -> Library:
        """The library of a store, from its persistent index (see `kvgraft.library.index`).

        `retriever`: None or "bm25" for BM25, a local sentence-transformers model directory for the dense
        retriever, or a Retriever.
        """
        if retriever is None or isinstance(retriever, str | Path):
            retriever = make_retriever(None if retriever in (None, "bm25") else retriever)
        # The texts kept are strings of the parsed index, scattered among the far larger part of it that is dropped,
        # and each would pin its block of the allocator's memory. Copied out once the parse is freed, they lie
        # packed: a library's resident memory is then about what it holds.
        packed = cls._of_entries(load_index(store).values())._packed()
        library = cls._unpacked(packed, retriever)
        release_free_memory()
        return library

    def _packed(self) -> str:
        """The library's lookups and documents as one JSON string (graft ids of documents stored once)."""

        def columns(docs: list[Doc]) -> list[list[Any]]:
            graft_ids = list(dict.fromkeys(doc[0] for doc in docs))
            position = {graft_id: i for i, graft_id in enumerate(graft_ids)}
            return [graft_ids, [position[doc[0]] for doc in docs], [doc[1] for doc in docs], [doc[2] for doc in docs]]

        formats = [[*key, graft_id] for key, graft_id in self.replay_by_format.items()]
        lookups = [self.replay_by_prompt, self.replay_problems, formats]
        return json.dumps([lookups, columns(self.block_entries), columns(self.other_entries)])

    @classmethod
    def _unpacked(cls, packed: str, retriever: Retriever) -> Library:
        (by_prompt, problems, formats), blocks, others = json.loads(packed)

        def docs(graft_ids: list[str], owners: list[int], labels: list[str], texts: list[str]) -> list[Doc]:
            return [(graft_ids[o], label, text) for o, label, text in zip(owners, labels, texts, strict=True)]

        by_format = {(prompt_format, sha): graft_id for prompt_format, sha, graft_id in formats}
        return cls(
            replay_by_prompt=by_prompt,
            replay_problems=problems,
            replay_by_format=by_format,
            block_entries=docs(*blocks),
            other_entries=docs(*others),
            retriever=retriever,
        )

    @classmethod
    def _of_entries(cls, entries: Iterable[IndexEntry]) -> Library:
        library = cls()
        for entry in entries:
            refs = entry.problem_refs
            if entry.kind is GraftKind.REPLAY and entry.prompt_tokens_sha256 and refs:
                library.replay_by_prompt[entry.prompt_tokens_sha256] = entry.id
                library.replay_problems[refs[0].problem_sha256] = entry.id
                library.replay_by_format[(entry.prompt_format or "plain", refs[0].problem_sha256)] = entry.id
            texts = [(entry.id, label, text) for label, text in entry.retrieval_texts()]
            (library.block_entries if entry.kind is GraftKind.BLOCK else library.other_entries).extend(texts)
        return library

    def find_replay(self, prompt_tokens: list[int]) -> str | None:
        """The replay graft whose prompt tokens equal these, found by their SHA-256."""
        return self.replay_by_prompt.get(sha256_token_ids(prompt_tokens))

    def find_replay_by_problem(self, problem_sha256: str, prompt_format: str = "plain") -> str | None:
        """The replay graft of a problem in a prompt format, found by the SHA-256 of the problem's text
        (`Item.text_sha256`).

        Unlike `find_replay` this needs no tokenizer and does not depend on how the prompt was encoded (with a
        subword tokenizer, the prompt's own tokens are not always a prefix of the graft's). The graft's
        fingerprint is still checked when it is restored. Several replay grafts of one problem in one format
        (other chat settings): the last one indexed."""
        return self.replay_by_format.get((prompt_format, problem_sha256))

    def holds(self, problem_sha256: str) -> bool:
        """Whether a verified solution of this problem is in the library (the problem is "seen")."""
        return problem_sha256 in self.replay_problems

    def search_blocks(self, query: str, k: int = 3) -> list[BlockHit]:
        """The best k blocks for a query, each scored by its best-matching problem, highest score first."""
        if not self.block_entries:
            return []
        self._indexed()
        return [
            BlockHit(graft_id, score, jaccard(query, text), problem_id)
            for (graft_id, problem_id, text), score in _best_per_graft(self.retriever, self.block_entries, query, k)
        ]

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The best k grafts of any kind for a query (blocks by their problems, others by summary or title)."""
        retriever, docs = self._indexed()
        return [
            Hit(graft_id, score, label, jaccard(query, text))
            for (graft_id, label, text), score in _best_per_graft(retriever, docs, query, k)
        ]

    def _indexed(self) -> tuple[Retriever, list[Doc]]:
        """Index the entries at first use: blocks in `retriever`, and all entries in a second index when there
        are other grafts (so that block scores do not depend on them). Returns the index of all entries."""
        if self._all is None:
            self.retriever.index([(str(i), text) for i, (_, _, text) in enumerate(self.block_entries)])
            if self.other_entries:
                docs = self.block_entries + self.other_entries
                everything = self.retriever.empty()
                everything.index([(str(i), text) for i, (_, _, text) in enumerate(docs)])
                self._all = (everything, docs)
            else:
                self._all = (self.retriever, self.block_entries)
            release_free_memory()  # what tokenizing every text took
        return self._all


def _best_per_graft(retriever: Retriever, docs: list[Doc], query: str, k: int) -> list[tuple[Doc, float]]:
    """The best k grafts' best documents with their scores, highest first (ties by graft id): the retriever is
    asked for more documents than k, and for more again while fewer than k grafts are among them."""
    n = min(len(docs), max(k * 8, 16))
    while True:
        hits = retriever.search(query, n)
        best: dict[str, tuple[Doc, float]] = {}
        for key, score in hits:
            doc = docs[int(key)]
            if doc[0] not in best:
                best[doc[0]] = (doc, score)
        if len(best) >= k or len(hits) < n or n >= len(docs):
            return sorted(best.values(), key=lambda h: (-h[1], h[0][0]))[:k]
        n = min(len(docs), n * 4)
