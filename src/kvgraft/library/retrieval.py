"""Retrievers: find the documents nearest a query, with scores, best first.

`BM25Retriever` (bm25s) is the default: lexical, no model, nothing to download. `DenseRetriever` embeds texts with
a sentence-transformers model loaded from a local directory only (never downloaded; the optional extra
`pip install kvgraft[dense]`) and scores by cosine similarity. Both index a list of (key, text) once and answer
`search(query, k)` with up to k (key, score) pairs sorted by score, highest first (ties in corpus order).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import bm25s
import numpy as np

from kvgraft.core.errors import BadInputError

# Numbers matter in these problems, so single characters count as tokens and no stop words are dropped.
TOKEN_PATTERN = r"(?u)\b\w+\b"


class Retriever(Protocol):
    name: str
    """"bm25", or "dense:<model path>" """

    def index(self, docs: Sequence[tuple[str, str]]) -> None:
        """Index these (key, text) documents, replacing whatever was indexed before."""

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """Up to k (key, score) pairs for the query, highest score first."""

    def empty(self) -> Retriever:
        """A retriever of the same kind with nothing indexed (a dense one shares its loaded model)."""


def _top(keys: Sequence[str], scores: np.ndarray[Any, Any], k: int) -> list[tuple[str, float]]:
    """The k best (key, score) pairs of a score vector, sorted by score then corpus order."""
    k = min(k, len(keys))
    if k <= 0:
        return []
    picked = np.argpartition(-scores, k - 1)[:k] if k < len(keys) else np.arange(len(keys))
    order = sorted(picked.tolist(), key=lambda i: (-float(scores[i]), i))
    return [(keys[i], float(scores[i])) for i in order]


class BM25Retriever:
    """Okapi BM25 over word tokens (bm25s); a document sharing no term with the query is not returned."""

    name = "bm25"

    def __init__(self) -> None:
        self._keys: np.ndarray[Any, np.dtype[np.str_]] = np.array([], dtype=str)
        """one fixed-width array rather than a string object per document: a library's memory stays flat"""
        self._bm25: bm25s.BM25 | None = None

    def empty(self) -> BM25Retriever:
        return BM25Retriever()

    def index(self, docs: Sequence[tuple[str, str]]) -> None:
        self._keys = np.array([key for key, _ in docs], dtype=str)
        self._bm25 = None
        if docs:
            corpus = bm25s.tokenize(
                [text for _, text in docs], stopwords=None, token_pattern=TOKEN_PATTERN, show_progress=False
            )
            if corpus.vocab:  # bm25s cannot index a corpus without a single word; nothing could match it anyway
                self._bm25 = bm25s.BM25()
                self._bm25.index(corpus, show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        k = min(k, len(self._keys))
        if self._bm25 is None or k <= 0:
            return []
        tokens = bm25s.tokenize([query], stopwords=None, token_pattern=TOKEN_PATTERN, show_progress=False)
        docs, scores = self._bm25.retrieve(tokens, k=k, show_progress=False)
        hits = [(i, s) for i, s in zip(docs[0].tolist(), scores[0].tolist(), strict=True) if s > 0.0]
        hits.sort(key=lambda h: (-h[1], h[0]))
        return [(str(self._keys[i]), float(s)) for i, s in hits]


class DenseRetriever:
    """Cosine similarity of sentence-transformers embeddings, from a local model directory (never downloaded)."""

    def __init__(self, model_path: str | Path, batch_size: int = 64) -> None:
        path = Path(model_path)
        if not path.is_dir():
            raise BadInputError(
                f"dense model {model_path}: not a local directory "
                "(give a sentence-transformers model directory; kvgraft never downloads one)"
            )
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise BadInputError(
                "the dense retriever needs sentence-transformers: pip install 'kvgraft[dense]'"
            ) from None
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self._model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BadInputError(f"dense model {model_path}: cannot load it ({reason})") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.name = f"dense:{path}"
        self.batch_size = batch_size
        self._keys: list[str] = []
        self._embeddings: np.ndarray[Any, Any] = np.zeros((0, 0), dtype=np.float32)

    def empty(self) -> DenseRetriever:
        other = copy.copy(self)
        other._keys, other._embeddings = [], np.zeros((0, 0), dtype=np.float32)
        return other

    def _encode(self, texts: list[str]) -> np.ndarray[Any, Any]:
        embeddings = self._model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(embeddings, dtype=np.float32)

    def index(self, docs: Sequence[tuple[str, str]]) -> None:
        self._keys = [key for key, _ in docs]
        self._embeddings = self._encode([text for _, text in docs]) if docs else np.zeros((0, 0), dtype=np.float32)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        if not self._keys or k <= 0:
            return []
        scores = self._embeddings @ self._encode([query])[0]
        return _top(self._keys, scores, k)


def make_retriever(dense_model: str | Path | None = None) -> Retriever:
    """BM25 by default; the dense retriever when a local sentence-transformers model directory is given."""
    return BM25Retriever() if dense_model is None else DenseRetriever(dense_model)
