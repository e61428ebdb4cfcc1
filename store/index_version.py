"""One version of an index as files: its settings, chunks and hits, and how a version is written.

:func:`write_version` writes everything of a version into a hidden folder, renames it into place and then
replaces ``CURRENT`` (atomic on POSIX), so a reader sees either the old version or the whole new one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from store.documents import Document
from store.embeddings import DEFAULT_MODEL, Embedder
from store.keyword_index import KeywordIndex

KEEP_VERSIONS = 2
CURRENT = "CURRENT"
KEYWORDS = "keywords"


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How an index is chunked and searched (``indexes.NAME`` in ``inferline.yaml``)."""

    type: Literal["flat", "ivf", "hnsw"] = "flat"
    model: str = DEFAULT_MODEL
    chunk_tokens: int = 200
    overlap: int = 40
    nlist: int = 1024          # ivf: clusters
    nprobe: int = 32           # ivf: clusters searched per query
    m: int = 32                # hnsw: links per node
    ef_construction: int = 200
    ef_search: int = 128

    def __post_init__(self) -> None:
        if not 0 <= self.overlap < self.chunk_tokens:
            raise ValueError(f"overlap ({self.overlap}) must be at least 0 and below chunk_tokens "
                             f"({self.chunk_tokens})")


@dataclass(frozen=True, slots=True)
class Chunk:
    id: int
    doc_id: str
    path: str
    title: str
    start: int          # character span in the document
    end: int
    token_start: int    # token span (the embedding model's tokens)
    token_end: int
    text: str
    page: int | None = None  # the page it starts on (PDF)


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result (``pipeline.protocols.SearchHit``)."""

    id: str
    text: str
    source: str
    title: str
    score: float
    doc_id: str
    page: int | None = None


@dataclass(frozen=True, slots=True)
class Retrieval:
    """One search (``pipeline.protocols.Retrieval``): the hits, and what each side found before fusion."""

    mode: str
    #: Best first: the fused order in hybrid mode.
    hits: list[Hit]
    #: The dense side's candidates, ``(id, cosine similarity)`` best first; empty when it did not search.
    dense: list[tuple[str, float]]
    #: The keyword side's candidates, ``(id, BM25 score)`` best first; empty when it did not search.
    keyword: list[tuple[str, float]]


def chunk_document(doc: Document, tokenizer: Any, chunk_tokens: int, overlap: int,
                   first_id: int = 0) -> list[Chunk]:
    """Windows of *chunk_tokens* tokens, *overlap* tokens shared with the previous one; the chunk text is
    the document's own text between the first and last token of the window."""
    offsets = tokenizer(doc.text, add_special_tokens=False, return_offsets_mapping=True,
                        verbose=False)["offset_mapping"]
    if not offsets:
        return []
    chunks, start, step = [], 0, chunk_tokens - overlap
    while True:
        end = min(start + chunk_tokens, len(offsets))
        char_start, char_end = offsets[start][0], offsets[end - 1][1]
        page = _page_of(doc.pages, char_start, char_end) if doc.pages else None
        chunks.append(Chunk(first_id + len(chunks), doc.doc_id, doc.path, doc.title, char_start, char_end,
                            start, end, doc.text[char_start:char_end], page))
        if end == len(offsets):
            return chunks
        start += step


def _page_of(pages: list[int], start: int, end: int) -> int:
    """The page (from 1) that holds most of the characters in [start, end): a chunk that runs over a page break
    cites the page where most of it is, the first one on a tie. *pages*: where each page starts."""
    first, last = bisect.bisect_right(pages, start), bisect.bisect_right(pages, max(start, end - 1))
    if first == last:
        return first
    spans = {page: min(end, pages[page] if page < len(pages) else end) - max(start, pages[page - 1])
             for page in range(first, last + 1)}
    return max(spans, key=lambda page: (spans[page], -page))


def chunk_all(docs: Iterable[Document], embedder: Embedder, settings: IndexSettings, first_id: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for doc in docs:
        chunks += chunk_document(doc, embedder.tokenizer, settings.chunk_tokens, settings.overlap,
                                 first_id + len(chunks))
    return chunks


def searched_text(chunk: Chunk) -> str:
    # The title goes with every chunk: a chunk from the middle of "Billing and plans" is about billing.
    return f"{chunk.title}\n\n{chunk.text}" if chunk.title else chunk.text


def embed(embedder: Embedder, chunks: list[Chunk]) -> np.ndarray:
    texts = [searched_text(c) for c in chunks]
    return embedder.encode(texts) if texts else np.zeros((0, embedder.dim), np.float32)


def document_entry(doc: Document) -> dict[str, Any]:
    """What the manifest keeps of a document (metadata and pages only when it has them)."""
    entry: dict[str, Any] = {"path": doc.path, "title": doc.title, "sha256": doc.sha256}
    if doc.metadata:
        entry["metadata"] = doc.metadata
    if doc.pages:
        entry["pages"] = len(doc.pages)
    return entry


def make_faiss_index(vectors: np.ndarray, settings: IndexSettings) -> faiss.Index:
    """A FAISS index over unit *vectors* with inner product (cosine) as the score."""
    dim = vectors.shape[1]
    if settings.type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, settings.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = settings.ef_construction
    elif settings.type == "ivf" and len(vectors) >= settings.nlist:
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, settings.nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
    else:  # flat, or IVF over fewer vectors than clusters (nothing to train on): exact
        index = faiss.IndexFlatIP(dim)
    if len(vectors):
        index.add(vectors)
    return index


@dataclass(slots=True)
class VersionFiles:
    """What :func:`write_version` wrote: the caller wraps it in a store."""

    folder: Path
    manifest: dict[str, Any]
    index: faiss.Index
    keywords: KeywordIndex


def write_version(root: Path, name: str, settings: IndexSettings, documents: Mapping[str, dict[str, Any]],
                  chunks: list[Chunk], vectors: np.ndarray, *, fields: Mapping[str, str],
                  skipped: list[tuple[str, str]]) -> VersionFiles:
    """Write a new version of index *name* under *root* and make it the current one."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    docs = {doc_id: dict(entry) for doc_id, entry in documents.items()}
    by_doc: dict[str, list[int]] = {}
    for c in chunks:
        by_doc.setdefault(c.doc_id, []).append(c.id)
    for doc_id, entry in docs.items():
        entry["chunks"] = by_doc.get(doc_id, [])
    now = datetime.now(UTC)
    digest = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()[:8]
    version = f"{now:%Y%m%dT%H%M%S%f}-{digest}"
    folder = root / version
    tmp = root / f".{version}.tmp"
    tmp.mkdir()
    manifest = {"name": name, "version": version, "created_at": now.isoformat(), "settings": asdict(settings),
                "dim": int(vectors.shape[1]), "num_chunks": len(chunks), "fields": dict(fields),
                "keyword": {"method": "bm25", "library": "bm25s", "stemmer": "english", "stopwords": "en"},
                "skipped": [{"path": path, "reason": reason} for path, reason in skipped], "documents": docs}
    index = make_faiss_index(vectors, settings)
    faiss.write_index(index, str(tmp / "index.faiss"))
    keywords = KeywordIndex.build([searched_text(c) for c in chunks])
    keywords.save(tmp / KEYWORDS)
    np.save(tmp / "vectors.npy", vectors)
    with open(tmp / "chunks.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in chunks)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    tmp.rename(folder)
    pointer = root / f".{CURRENT}.tmp"
    pointer.write_text(version + "\n")
    os.replace(pointer, root / CURRENT)  # the swap: atomic on POSIX
    _prune(root, keep=version)
    return VersionFiles(folder, manifest, index, keywords)


def _prune(root: Path, keep: str) -> None:
    versions = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for old in versions[:-KEEP_VERSIONS]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


__all__ = ["CURRENT", "KEYWORDS", "Chunk", "Hit", "IndexSettings", "Retrieval", "VersionFiles", "chunk_all",
           "chunk_document", "document_entry", "embed", "make_faiss_index", "searched_text", "write_version"]
