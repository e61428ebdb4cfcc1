"""The keyword side of an index: BM25 over the same chunks as its vectors (``bm25s``, Snowball stemming).

Words are lowercased, English stop words dropped and the rest stemmed (PyStemmer), so "refunded" finds
"refunds"; a product code such as ``LX-4410`` is the tokens ``lx`` and ``4410``, which an embedding
model blurs and BM25 matches exactly. It is saved in the index version's ``keywords/`` folder and rebuilt
with every version, over every chunk: BM25's weights depend on the whole collection.
"""

from __future__ import annotations

import threading
from pathlib import Path

import bm25s
import numpy as np
import Stemmer

_local = threading.local()


def tokenize(texts: list[str]) -> list[list[str]]:
    """Each text as the stemmed tokens BM25 indexes and queries with."""
    stemmer = getattr(_local, "stemmer", None)
    if stemmer is None:  # a stemmer keeps a cache: one per thread
        stemmer = _local.stemmer = Stemmer.Stemmer("english")
    return bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False)


class KeywordIndex:
    """BM25 scores of a query over the chunks, by chunk row."""

    def __init__(self, bm25: bm25s.BM25 | None, size: int):
        self._bm25 = bm25
        self.size = size

    @classmethod
    def build(cls, texts: list[str]) -> KeywordIndex:
        if not texts:
            return cls(None, 0)
        bm25 = bm25s.BM25()
        bm25.index(tokenize(texts), show_progress=False)
        return cls(bm25, len(texts))

    def save(self, folder: Path) -> None:
        folder.mkdir()
        (folder / "size").write_text(f"{self.size}\n")
        if self._bm25 is not None:
            self._bm25.save(str(folder), show_progress=False)

    @classmethod
    def load(cls, folder: Path) -> KeywordIndex:
        size = int((folder / "size").read_text())
        bm25 = bm25s.BM25.load(str(folder), show_progress=False) if size else None
        return cls(bm25, size)

    def search(self, query: str, k: int, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the *k* best-scoring chunks for *query* (only rows where *mask* is true), best first,
        and their scores; chunks sharing no word with the query are never returned."""
        if self._bm25 is None or k <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        tokens = tokenize([query])[0]
        if not tokens:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        scores = self._bm25.get_scores(tokens)
        if mask is not None:
            scores = np.where(mask, scores, 0.0)
        matched = np.flatnonzero(scores > 0)
        if len(matched) > k:
            matched = matched[np.argpartition(-scores[matched], k - 1)[:k]]
        order = matched[np.lexsort((matched, -scores[matched]))]  # best first; ties by row, for a stable order
        return order.astype(np.int64), scores[order].astype(np.float32)


__all__ = ["KeywordIndex", "tokenize"]
