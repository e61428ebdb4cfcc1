"""Indexes on disk: chunked documents, their embeddings in FAISS and their words in BM25, versioned.

Layout of an index folder::

    indexes/handbook/
      CURRENT                  # the live version's id (replaced atomically)
      20261130T001500-1a2b3c4d/
        manifest.json          # name, version, settings, declared metadata fields, documents (path, hash, title,
                               # chunk ids, metadata), the files skipped and why
        chunks.jsonl           # one chunk per line: id, doc_id, path, title, char and token span, text, page
        vectors.npy            # the embeddings (float32, unit length), kept so `add` re-embeds only changes
        index.faiss            # flat (exact inner product), IVF or HNSW
        keywords/              # BM25 over the same chunks (bm25s)

A build, an ``add`` or a ``remove`` writes a new version folder, then points ``CURRENT`` at it; readers
that loaded the old version keep it until they let it go, so a server swaps indexes without failing a
request. The last two versions are kept. :meth:`VectorStore.retrieve` searches dense, keyword or hybrid
(both sides, fused), with metadata filters applied inside each side's search, before its top k.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from store.documents import BUILTIN_FIELDS, Document, Scan, read_documents
from store.embeddings import Embedder
from store.fusion import reciprocal_rank_fusion, weighted_fusion
from store.index_version import (
    CURRENT,
    KEYWORDS,
    Chunk,
    Hit,
    IndexSettings,
    Retrieval,
    chunk_all,
    chunk_document,
    document_entry,
    embed,
    make_faiss_index,
    write_version,
)
from store.keyword_index import KeywordIndex
from store.metadata_filter import globs, matches
from store.readers import SUFFIXES

Mode = Literal["dense", "keyword", "hybrid"]
MODES: tuple[str, ...] = ("dense", "keyword", "hybrid")


class VectorStore:
    """One version of one index, loaded: search it, or derive the next version with ``add`` or ``remove``."""

    def __init__(self, folder: Path, manifest: dict[str, Any], chunks: list[Chunk], vectors: np.ndarray,
                 index: faiss.Index, embedder: Embedder | None, keywords: KeywordIndex | None = None):
        self.folder = folder
        self.manifest = manifest
        self.chunks = chunks
        self.vectors = vectors
        self.index = index
        #: The BM25 side; None for a version built before indexes had one (dense search only).
        self.keywords = keywords
        self._embedder = embedder
        # Filters are evaluated per document, then spread to its chunks through this row -> document map.
        documents = manifest.get("documents", {})
        first = {c.doc_id: c for c in reversed(chunks)}  # each document's first chunk
        ordinal = {doc_id: n for n, doc_id in enumerate(first)}
        self._chunk_doc = np.fromiter((ordinal[c.doc_id] for c in chunks), np.int64, len(chunks))
        self._doc_values = [_values(chunk, documents.get(doc_id)) for doc_id, chunk in first.items()]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    @property
    def settings(self) -> IndexSettings:
        return IndexSettings(**self.manifest["settings"])

    @property
    def fields(self) -> dict[str, str]:
        """The metadata fields the index was built with, by type (the built-in ones too)."""
        return {**BUILTIN_FIELDS, **self.manifest.get("fields", {})}

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """The files the build or ``add`` that made this version could not read, with the reason."""
        return [(s["path"], s["reason"]) for s in self.manifest.get("skipped", [])]

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            from store.embeddings import shared_embedder

            self._embedder = shared_embedder(self.settings.model)
        return self._embedder

    # --- building ------------------------------------------------------------------------

    @classmethod
    def build(cls, root: Path, name: str, docs: Path, settings: IndexSettings, embedder: Embedder | None = None,
              *, fields: Mapping[str, str] | None = None) -> VectorStore:
        """Index every document under *docs* from scratch, as a new version of *root*; *fields* are the
        declared metadata fields and their types. Files that cannot be read are skipped (``skipped``)."""
        from store.embeddings import shared_embedder

        embedder = embedder or shared_embedder(settings.model)
        scan = _readable(read_documents(docs, fields), docs)
        chunks = chunk_all(scan.documents, embedder, settings, first_id=0)
        documents = {d.doc_id: document_entry(d) for d in scan.documents}
        return cls._write(Path(root), name, settings, documents, chunks, embed(embedder, chunks), embedder,
                          fields or {}, scan.skipped)

    def add(self, docs: Path, *, keep_missing: bool = False,
            fields: Mapping[str, str] | None = None) -> tuple[VectorStore, dict[str, list[str]]]:
        """A new version with new and changed documents (re)embedded and the rest reused.

        Documents are matched by id; a changed content hash (of the file and its metadata) replaces the old
        chunks. A document whose file is gone from *docs* is removed, unless *keep_missing*. Returns the new
        version and what changed: added, changed, unchanged, removed, and skipped (``path: reason``).
        """
        fields = self.manifest.get("fields", {}) if fields is None else fields
        scan = read_documents(docs, fields)
        known = self.manifest["documents"]
        changes: dict[str, list[str]] = {"added": [], "changed": [], "unchanged": [], "removed": [],
                                         "skipped": [f"{path}: {reason}" for path, reason in scan.skipped]}
        for doc in scan.documents:
            entry = known.get(doc.doc_id)
            kind = "added" if entry is None else "unchanged" if entry["sha256"] == doc.sha256 else "changed"
            changes[kind].append(doc.doc_id)
        if not keep_missing:
            changes["removed"] = sorted(doc_id for doc_id, entry in known.items()
                                        if not (scan.base / entry["path"]).exists())
        fresh = [d for d in scan.documents if d.doc_id in set(changes["added"]) | set(changes["changed"])]
        return self._derive({d.doc_id for d in fresh} | set(changes["removed"]), fresh, fields, scan.skipped), changes

    def remove(self, doc_ids: list[str]) -> VectorStore:
        """A new version without the documents *doc_ids* (ids or paths); raises KeyError naming an unknown one."""
        known = self.manifest["documents"]
        by_path = {entry["path"]: doc_id for doc_id, entry in known.items()}
        wanted = set()
        for name in doc_ids:
            doc_id = name if name in known else by_path.get(name)
            if doc_id is None:
                raise KeyError(f"no document {name!r} in index {self.name!r} (ids are paths without the suffix, "
                               f"as `inferline index info` lists them)")
            wanted.add(doc_id)
        return self._derive(wanted, [], self.manifest.get("fields", {}), [])

    def _derive(self, dropped: set[str], fresh: list[Document], fields: Mapping[str, str],
                skipped: list[tuple[str, str]]) -> VectorStore:
        kept = [c for c in self.chunks if c.doc_id not in dropped]
        keep_rows = np.array([c.id for c in kept], dtype=np.int64)
        renumbered = [_renumber(c, i) for i, c in enumerate(kept)]
        new_chunks = chunk_all(fresh, self.embedder, self.settings, first_id=len(renumbered)) if fresh else []
        old = self.vectors[keep_rows] if len(kept) else np.zeros((0, self.vectors.shape[1]), np.float32)
        vectors = np.concatenate([old, embed(self.embedder, new_chunks)]) if new_chunks else old
        documents = {doc_id: {k: v for k, v in entry.items() if k != "chunks"}
                     for doc_id, entry in self.manifest["documents"].items() if doc_id not in dropped}
        documents.update({d.doc_id: document_entry(d) for d in fresh})
        return self._write(self.folder.parent, self.name, self.settings, documents, renumbered + new_chunks,
                           vectors, self.embedder, fields, skipped)

    @classmethod
    def _write(cls, root: Path, name: str, settings: IndexSettings, documents: dict[str, dict[str, Any]],
               chunks: list[Chunk], vectors: np.ndarray, embedder: Embedder, fields: Mapping[str, str],
               skipped: list[tuple[str, str]]) -> VectorStore:
        files = write_version(root, name, settings, documents, chunks, vectors, fields=fields, skipped=skipped)
        return cls(files.folder, files.manifest, chunks, vectors, files.index, embedder, files.keywords)

    # --- reading ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: Path, embedder: Embedder | None = None) -> VectorStore:
        """The current version of the index at *root*."""
        root = Path(root)
        try:
            version = (root / CURRENT).read_text().strip()
        except FileNotFoundError:
            raise FileNotFoundError(f"no index at {root}: build it with `inferline index build`") from None
        return cls.load(root / version, embedder)

    @classmethod
    def load(cls, folder: Path, embedder: Embedder | None = None) -> VectorStore:
        manifest = json.loads((folder / "manifest.json").read_text())
        with open(folder / "chunks.jsonl", encoding="utf-8") as lines:
            chunks = [Chunk(**json.loads(line)) for line in lines]
        vectors = np.load(folder / "vectors.npy")
        index = faiss.read_index(str(folder / "index.faiss"))
        keywords = KeywordIndex.load(folder / KEYWORDS) if (folder / KEYWORDS).is_dir() else None
        return cls(folder, manifest, chunks, vectors, index, embedder, keywords)

    @staticmethod
    def current_version(root: Path) -> str | None:
        try:
            return (Path(root) / CURRENT).read_text().strip()
        except FileNotFoundError:
            return None

    @property
    def default_mode(self) -> Mode:
        """hybrid when the index has a keyword side (every index built since it had one), else dense."""
        return "hybrid" if self.keywords is not None else "dense"

    def search(self, query: str, top_k: int = 4, *, min_score: float | None = None,
               filters: Mapping[str, str | list[str]] | None = None, mode: Mode | None = None) -> list[Hit]:
        """The *top_k* chunks best matching *query*, best first (dense search unless *mode* says otherwise);
        *filters* match ``doc_id``, ``path`` or ``title`` against glob patterns (a list: any of them)."""
        where = globs(filters) if filters else None
        return self.retrieve(query, top_k, mode=mode or "dense", min_score=min_score, where=where).hits

    def retrieve(self, query: str, top_k: int = 4, *, mode: Mode | None = None, min_score: float | None = None,
                 where: Mapping[str, Any] | None = None, fusion: str = "rrf", rrf_k: int = 60,
                 weights: Mapping[str, float] | None = None, candidates: int = 50) -> Retrieval:
        """Search *query* by *mode* (None: :attr:`default_mode`): the *top_k* hits and each side's candidates.

        *where* (a :mod:`store.metadata_filter` filter) keeps only the documents it matches, inside each
        side's search. *min_score* drops candidates whose cosine similarity to the query is below it, in every
        mode. Hybrid mode takes *candidates* from each side and fuses them by *fusion*: ``rrf`` (reciprocal
        rank fusion with *rrf_k*) or ``weighted`` (min-max scaled scores); *weights* by side (dense, keyword).
        """
        mode = mode or self.default_mode
        if mode not in MODES:
            raise ValueError(f"unknown search mode {mode!r} (one of {', '.join(MODES)})")
        if mode != "dense" and self.keywords is None:
            raise ValueError(f"index {self.name!r} (version {self.version}) has no keyword side: it was built "
                             "before indexes had one; rebuild it with `inferline index build` for keyword or "
                             "hybrid search")
        mask = self._mask(where) if where else None
        depth = top_k if mode != "hybrid" else max(top_k, candidates)
        needs_vector = mode != "keyword" or min_score is not None
        vector = self.embedder.encode([query])[0] if needs_vector and len(self.chunks) else None
        dense = self._dense(vector, depth, mask, min_score) if mode != "keyword" else []
        keyword: list[tuple[int, float]] = []
        if mode != "dense":
            rows, scores = self.keywords.search(query, depth, mask)  # type: ignore[union-attr]
            keyword = [(int(r), float(s)) for r, s in zip(rows, scores, strict=True)]
            if min_score is not None and keyword:
                cosines = self.vectors[[r for r, _ in keyword]] @ vector
                keyword = [pair for pair, cos in zip(keyword, cosines, strict=True) if cos >= min_score]
        if mode == "hybrid":
            sides = {"dense": dense, "keyword": keyword}
            ranked = weighted_fusion(sides, weights) if fusion == "weighted" else \
                reciprocal_rank_fusion(sides, rrf_k, weights)
        else:
            ranked = dense or keyword
        hits = [self._hit(row, score) for row, score in ranked[:top_k]]
        return Retrieval(mode, hits, [(self._id(r), round(s, 4)) for r, s in dense],
                         [(self._id(r), round(s, 4)) for r, s in keyword])

    def _dense(self, vector: np.ndarray | None, k: int, mask: np.ndarray | None,
               min_score: float | None) -> list[tuple[int, float]]:
        total = self.index.ntotal
        if vector is None or total == 0 or (mask is not None and not mask.any()):
            return []
        bits = np.packbits(mask, bitorder="little") if mask is not None else None
        selector = faiss.IDSelectorBitmap(len(mask), faiss.swig_ptr(bits)) if bits is not None else None
        if isinstance(self.index, faiss.IndexHNSWFlat):
            params = faiss.SearchParametersHNSW(sel=selector, efSearch=max(self.settings.ef_search, k))
        elif isinstance(self.index, faiss.IndexIVF):
            params = faiss.SearchParametersIVF(sel=selector, nprobe=self.settings.nprobe)
        else:
            params = faiss.SearchParameters(sel=selector) if selector is not None else None
        scores, rows = self.index.search(vector.reshape(1, -1).astype(np.float32), min(total, k), params=params)
        del bits  # the selector reads it until here
        return [(int(row), float(score)) for score, row in zip(scores[0], rows[0], strict=True)
                if row >= 0 and (min_score is None or score >= min_score)]

    def _mask(self, where: Mapping[str, Any]) -> np.ndarray:
        documents = np.fromiter((matches(where, values) for values in self._doc_values), bool,
                                len(self._doc_values))
        return documents[self._chunk_doc] if len(self._chunk_doc) else np.zeros(0, bool)

    def _id(self, row: int) -> str:
        chunk = self.chunks[row]
        return f"{chunk.doc_id}#{chunk.id}"

    def _hit(self, row: int, score: float) -> Hit:
        c = self.chunks[row]
        return Hit(f"{c.doc_id}#{c.id}", c.text, c.path, c.title, float(score), c.doc_id, c.page)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "type": self.settings.type,
                "model": self.settings.model, "dim": int(self.vectors.shape[1]), "chunks": len(self.chunks),
                "documents": len(self.manifest["documents"]), "created_at": self.manifest["created_at"],
                "keyword": self.keywords is not None, "default_mode": self.default_mode,
                "fields": self.fields, "skipped": self.manifest.get("skipped", []),
                "settings": self.manifest["settings"], "folder": str(self.folder)}


def _values(chunk: Chunk, entry: dict[str, Any] | None) -> dict[str, Any]:
    """What filters see of a document (one of its chunks and its manifest entry): metadata and built-in fields."""
    metadata = (entry or {}).get("metadata", {})
    return {**metadata, "doc_id": chunk.doc_id, "path": chunk.path, "title": chunk.title}


def _renumber(chunk: Chunk, new_id: int) -> Chunk:
    return Chunk(new_id, chunk.doc_id, chunk.path, chunk.title, chunk.start, chunk.end, chunk.token_start,
                 chunk.token_end, chunk.text, chunk.page)


def _readable(scan: Scan, docs: Path) -> Scan:
    if not scan.documents:
        reasons = "; ".join(f"{path}: {reason}" for path, reason in scan.skipped)
        raise ValueError(f"no document under {docs} could be read ({reasons})")
    return scan


__all__ = ["MODES", "SUFFIXES", "Chunk", "Document", "Hit", "IndexSettings", "Retrieval", "VectorStore",
           "chunk_document", "make_faiss_index", "read_documents"]
