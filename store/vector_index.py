"""Vector indexes on disk: chunked documents, their embeddings and a FAISS index, versioned.

Layout of an index folder::

    indexes/handbook/
      CURRENT                  # the live version's id (replaced atomically)
      20261130T001500-1a2b3c4d/
        manifest.json          # name, version, model, settings, documents (path, hash, title, chunk ids)
        chunks.jsonl           # one chunk per line: id, doc_id, path, title, char and token span, text
        vectors.npy            # the embeddings (float32, unit length), kept so `add` re-embeds only changes
        index.faiss            # flat (exact inner product), IVF or HNSW

A build or an ``add`` writes a new version folder, then points ``CURRENT`` at
it; readers that loaded the old version keep it until they let it go, so a
server swaps indexes without failing a request. The last two versions are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from store.embeddings import DEFAULT_MODEL, Embedder

#: Files read by ``build`` and ``add``: text formats that need no converter.
TEXT_SUFFIXES = (".md", ".markdown", ".txt", ".rst", ".text")
KEEP_VERSIONS = 2
CURRENT = "CURRENT"


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


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result (``pipeline.protocols.SearchHit``)."""

    id: str
    text: str
    source: str
    title: str
    score: float
    doc_id: str


@dataclass(slots=True)
class Document:
    doc_id: str
    path: str
    title: str
    text: str
    sha256: str


def read_documents(root: Path) -> list[Document]:
    """Every text file under *root* (or *root* itself), sorted; ids are paths without suffix."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no {', '.join(TEXT_SUFFIXES)} files under {root}")
    base = root.parent if root.is_file() else root
    docs = []
    for path in files:
        data = path.read_bytes()
        text = data.decode("utf-8", errors="replace")
        rel = path.relative_to(base).as_posix()
        docs.append(Document(rel.rsplit(".", 1)[0], rel, _title(text, path), text, hashlib.sha256(data).hexdigest()))
    return docs


def _title(text: str, path: Path) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
        if line.strip():
            break
    return path.stem.replace("-", " ").replace("_", " ")


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
        chunks.append(Chunk(first_id + len(chunks), doc.doc_id, doc.path, doc.title, char_start, char_end,
                            start, end, doc.text[char_start:char_end]))
        if end == len(offsets):
            return chunks
        start += step


class VectorStore:
    """One version of one index, loaded: search it, or derive the next version with ``add``."""

    def __init__(self, folder: Path, manifest: dict[str, Any], chunks: list[Chunk], vectors: np.ndarray,
                 index: faiss.Index, embedder: Embedder | None):
        self.folder = folder
        self.manifest = manifest
        self.chunks = chunks
        self.vectors = vectors
        self.index = index
        self._embedder = embedder

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
    def embedder(self) -> Embedder:
        if self._embedder is None:
            from store.embeddings import shared_embedder

            self._embedder = shared_embedder(self.settings.model)
        return self._embedder

    # --- building ------------------------------------------------------------------------

    @classmethod
    def build(cls, root: Path, name: str, docs: Path, settings: IndexSettings,
              embedder: Embedder | None = None) -> VectorStore:
        """Index every document under *docs* from scratch, as a new version of *root*."""
        from store.embeddings import shared_embedder

        embedder = embedder or shared_embedder(settings.model)
        documents = read_documents(docs)
        chunks = _chunk_all(documents, embedder, settings, first_id=0)
        vectors = _embed(embedder, chunks)
        return _write_version(root, name, settings, documents, chunks, vectors, embedder)

    def add(self, docs: Path) -> tuple[VectorStore, dict[str, list[str]]]:
        """A new version with new and changed documents (re)embedded and the rest reused.

        Documents are matched by id; a changed content hash replaces the old chunks. Documents not
        under *docs* stay. Returns the new version and what changed: added, changed, unchanged.
        """
        incoming = read_documents(docs)
        known = self.manifest["documents"]
        changes: dict[str, list[str]] = {"added": [], "changed": [], "unchanged": []}
        for doc in incoming:
            entry = known.get(doc.doc_id)
            kind = "added" if entry is None else "unchanged" if entry["sha256"] == doc.sha256 else "changed"
            changes[kind].append(doc.doc_id)
        replaced = set(changes["added"]) | set(changes["changed"])
        kept = [c for c in self.chunks if c.doc_id not in replaced]
        keep_rows = np.array([c.id for c in kept], dtype=np.int64)
        renumbered = [Chunk(i, *_fields(c)[1:]) for i, c in enumerate(kept)]
        fresh_docs = [d for d in incoming if d.doc_id in replaced]
        fresh = _chunk_all(fresh_docs, self.embedder, self.settings, first_id=len(renumbered))
        vectors = np.concatenate([self.vectors[keep_rows] if len(kept) else
                                  np.zeros((0, self.vectors.shape[1]), np.float32), _embed(self.embedder, fresh)])
        documents = {doc_id: entry for doc_id, entry in known.items() if doc_id not in replaced}
        documents.update({d.doc_id: {"path": d.path, "title": d.title, "sha256": d.sha256} for d in fresh_docs})
        store = _write_version(self.folder.parent, self.name, self.settings, documents, renumbered + fresh,
                               vectors, self.embedder)
        return store, changes

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
        return cls(folder, manifest, chunks, vectors, index, embedder)

    @staticmethod
    def current_version(root: Path) -> str | None:
        try:
            return (Path(root) / CURRENT).read_text().strip()
        except FileNotFoundError:
            return None

    def search(self, query: str, top_k: int = 4, *, min_score: float | None = None,
               filters: Mapping[str, str | list[str]] | None = None) -> list[Hit]:
        """The *top_k* chunks nearest to *query*, best first; *filters* match ``doc_id``, ``path`` or
        ``title`` against glob patterns (a list: any of them)."""
        return self.search_vector(self.embedder.encode([query])[0], top_k, min_score=min_score, filters=filters)

    def search_vector(self, vector: np.ndarray, top_k: int, *, min_score: float | None = None,
                      filters: Mapping[str, str | list[str]] | None = None) -> list[Hit]:
        total = self.index.ntotal
        if total == 0:
            return []
        fetch = min(total, top_k * 10 if filters else top_k)
        _tune(self.index, self.settings)
        scores, ids = self.index.search(vector.reshape(1, -1).astype(np.float32), fetch)
        hits = []
        for score, row in zip(scores[0], ids[0], strict=True):
            if row < 0 or (min_score is not None and score < min_score):
                continue
            chunk = self.chunks[row]
            if filters and not _matches(chunk, filters):
                continue
            hits.append(Hit(f"{chunk.doc_id}#{chunk.id}", chunk.text, chunk.path, chunk.title, float(score),
                            chunk.doc_id))
            if len(hits) == top_k:
                break
        return hits

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "type": self.settings.type,
                "model": self.settings.model, "dim": int(self.vectors.shape[1]), "chunks": len(self.chunks),
                "documents": len(self.manifest["documents"]), "created_at": self.manifest["created_at"],
                "settings": self.manifest["settings"], "folder": str(self.folder)}


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


def _tune(index: faiss.Index, settings: IndexSettings) -> None:
    if isinstance(index, faiss.IndexHNSWFlat):
        index.hnsw.efSearch = settings.ef_search
    elif isinstance(index, faiss.IndexIVF):
        index.nprobe = settings.nprobe


def _matches(chunk: Chunk, filters: Mapping[str, str | list[str]]) -> bool:
    for key, wanted in filters.items():
        patterns = [wanted] if isinstance(wanted, str) else wanted
        if not any(fnmatch(str(getattr(chunk, key)), pattern) for pattern in patterns):
            return False
    return True


def _fields(chunk: Chunk) -> tuple[Any, ...]:
    return tuple(getattr(chunk, name) for name in Chunk.__slots__)  # type: ignore[attr-defined]


def _chunk_all(docs: Iterable[Document], embedder: Embedder, settings: IndexSettings, first_id: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for doc in docs:
        chunks += chunk_document(doc, embedder.tokenizer, settings.chunk_tokens, settings.overlap,
                                 first_id + len(chunks))
    return chunks


def _embed(embedder: Embedder, chunks: list[Chunk]) -> np.ndarray:
    # The title goes with every chunk: a chunk from the middle of "Billing and plans" is about billing.
    texts = [f"{c.title}\n\n{c.text}" if c.title else c.text for c in chunks]
    return embedder.encode(texts) if texts else np.zeros((0, embedder.dim), np.float32)


def _write_version(root: Path, name: str, settings: IndexSettings, documents: list[Document] | dict[str, Any],
                   chunks: list[Chunk], vectors: np.ndarray, embedder: Embedder) -> VectorStore:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    docs = documents if isinstance(documents, dict) else {
        d.doc_id: {"path": d.path, "title": d.title, "sha256": d.sha256} for d in documents}
    for doc_id, entry in docs.items():
        entry["chunks"] = [c.id for c in chunks if c.doc_id == doc_id]
    now = datetime.now(UTC)
    digest = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()[:8]
    version = f"{now:%Y%m%dT%H%M%S%f}-{digest}"
    folder = root / version
    tmp = root / f".{version}.tmp"
    tmp.mkdir()
    manifest = {"name": name, "version": version, "created_at": now.isoformat(), "settings": asdict(settings),
                "dim": int(vectors.shape[1]), "num_chunks": len(chunks), "documents": docs}
    index = make_faiss_index(vectors, settings)
    faiss.write_index(index, str(tmp / "index.faiss"))
    np.save(tmp / "vectors.npy", vectors)
    with open(tmp / "chunks.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in chunks)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    tmp.rename(folder)
    pointer = root / f".{CURRENT}.tmp"
    pointer.write_text(version + "\n")
    os.replace(pointer, root / CURRENT)  # the swap: atomic on POSIX
    _prune(root, keep=version)
    return VectorStore(folder, manifest, chunks, vectors, index, embedder)


def _prune(root: Path, keep: str) -> None:
    versions = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for old in versions[:-KEEP_VERSIONS]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


__all__ = ["Chunk", "Hit", "IndexSettings", "VectorStore", "chunk_document", "make_faiss_index",
           "read_documents"]
