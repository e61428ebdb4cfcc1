"""Vector indexes on the real FAISS and the real embedding model (all-MiniLM-L6-v2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from store.vector_index import Document, IndexSettings, VectorStore, chunk_document, make_faiss_index

ROOT = Path(__file__).parents[2]
HANDBOOK = ROOT / "pipelines" / "data" / "handbook"


class WordTokenizer:
    """Whitespace-separated words as tokens, with character offsets (like a fast HF tokenizer)."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=True, verbose=False):
        return {"offset_mapping": [m.span() for m in re.finditer(r"\S+", text)]}


def doc(text: str) -> Document:
    return Document("d", "d.md", "D", text, "0" * 64)


def test_chunks_are_windows_with_overlap_over_the_original_text():
    text = " ".join(f"w{i}" for i in range(10))
    chunks = chunk_document(doc(text), WordTokenizer(), chunk_tokens=4, overlap=1)
    assert [c.text for c in chunks] == ["w0 w1 w2 w3", "w3 w4 w5 w6", "w6 w7 w8 w9"]
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, 4), (3, 7), (6, 10)]
    assert all(text[c.start:c.end] == c.text for c in chunks)
    assert [c.id for c in chunks] == [0, 1, 2]


@pytest.mark.parametrize(("words", "size", "overlap", "expected"), [
    (3, 4, 1, 1), (4, 4, 1, 1), (5, 4, 1, 2), (7, 4, 0, 2), (0, 4, 1, 0)])
def test_chunk_counts_at_the_boundaries(words, size, overlap, expected):
    text = " ".join("x" for _ in range(words))
    chunks = chunk_document(doc(text), WordTokenizer(), size, overlap)
    assert len(chunks) == expected
    if chunks:
        assert chunks[-1].token_end == words  # the last token is always covered


def test_settings_refuse_an_overlap_as_long_as_the_chunk():
    with pytest.raises(ValueError, match="overlap"):
        IndexSettings(chunk_tokens=10, overlap=10)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_faiss_index_types_find_the_nearest_vectors(kind):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((2000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = make_faiss_index(vectors, IndexSettings(type=kind, nlist=16, nprobe=16))
    if kind == "hnsw":
        index.hnsw.efSearch = 64
    _, ids = index.search(vectors[:20], 1)
    assert list(ids[:, 0]) == list(range(20))


# --- the real embedding model -----------------------------------------------------

pytestmark_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def embedder():
    from store.embeddings import shared_embedder

    return shared_embedder()


def write_docs(folder: Path, pages: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (folder / name).write_text(text)
    return folder


PAGES = {
    "billing.md": "# Billing\n\nThe Plus plan costs eight dollars per user per month, billed monthly.",
    "shortcuts.md": "# Shortcuts\n\nPress Ctrl+Shift+K to open the command palette.",
    "sync.md": "# Offline sync\n\nThe desktop app keeps the last 500 notes available offline.",
}


@pytest.mark.slow
def test_build_search_info_and_filters(tmp_path, embedder):
    docs = write_docs(tmp_path / "docs", PAGES)
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(chunk_tokens=32, overlap=8), embedder)
    hits = store.search("How much is the Plus plan?", top_k=2)
    assert hits[0].source == "billing.md" and hits[0].title == "Billing" and hits[0].id.startswith("billing#")
    assert hits[0].score > hits[1].score
    assert "eight dollars" in hits[0].text
    filtered = store.search("How much is the Plus plan?", top_k=2, filters={"path": ["sync*", "short*"]})
    assert {h.source for h in filtered} == {"sync.md", "shortcuts.md"}
    assert store.search("How much is the Plus plan?", top_k=3, min_score=0.99) == []
    info = store.info()
    assert (info["name"], info["documents"], info["type"], info["dim"]) == ("kb", 3, "flat", 384)
    manifest = json.loads((store.folder / "manifest.json").read_text())
    assert set(manifest["documents"]["billing"]) == {"path", "title", "sha256", "chunks"}
    reopened = VectorStore.open(tmp_path / "index", embedder)
    assert reopened.version == store.version
    assert [h.id for h in reopened.search("command palette", 1)] == [h.id for h in store.search("command palette", 1)]


@pytest.mark.slow
def test_add_embeds_only_new_and_changed_documents(tmp_path, embedder, monkeypatch):
    docs = write_docs(tmp_path / "docs", PAGES)
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(), embedder)
    (docs / "sync.md").write_text("# Offline sync\n\nThe desktop app now keeps 900 notes offline.")
    (docs / "export.md").write_text("# Export\n\nExport a workspace as Markdown from Settings.")
    embedded: list[str] = []
    original = embedder.encode
    monkeypatch.setattr(embedder, "encode", lambda texts: embedded.extend(texts) or original(texts))
    new, changes = store.add(docs)
    assert changes == {"added": ["export"], "changed": ["sync"], "unchanged": ["billing", "shortcuts"],
                       "removed": [], "skipped": []}
    assert len(embedded) == 2 and all("Export" in t or "900" in t for t in embedded)
    assert new.version != store.version and VectorStore.current_version(tmp_path / "index") == new.version
    assert "900 notes" in new.search("How many notes are kept offline?", 1)[0].text
    assert new.search("Ctrl+Shift+K", 1)[0].source == "shortcuts.md"  # reused, not re-embedded
    assert sorted(c.id for c in new.chunks) == list(range(len(new.chunks)))


@pytest.mark.slow
def test_handbook_questions_find_their_page_first(tmp_path, embedder):
    store = VectorStore.build(tmp_path / "index", "handbook", HANDBOOK, IndexSettings(), embedder)
    cases = [json.loads(line) for line in (ROOT / "evals" / "handbook_questions.jsonl").read_text().splitlines()]
    assert len(cases) == 10
    first = [store.search(case["question"], 1)[0].source.removesuffix(".md") for case in cases]
    correct = sum(page == case["page"] for page, case in zip(first, cases, strict=True))
    assert correct >= 8, list(zip(first, [c["page"] for c in cases], strict=True))


def test_a_chunk_over_a_page_break_cites_the_page_that_holds_most_of_it():
    # Page 1: "a0 ... a5" (17 characters), page 2 from character 19: "b0 ... b1".
    text = " ".join(f"a{i}" for i in range(6)) + "\n\n" + " ".join(f"b{i}" for i in range(6))
    paged = Document("d", "d.pdf", "D", text, "0" * 64, {}, [0, text.index("b0")])
    chunks = chunk_document(paged, WordTokenizer(), chunk_tokens=4, overlap=0)
    assert [c.text.split()[0] for c in chunks] == ["a0", "a4", "b2"]
    assert [c.page for c in chunks] == [1, 1, 2]  # "a4 a5\n\nb0 b1": 7 characters on page 1, 5 on page 2
    late = chunk_document(paged, WordTokenizer(), chunk_tokens=5, overlap=0)
    assert [(c.text, c.page) for c in late] == [("a0 a1 a2 a3 a4", 1), ("a5\n\nb0 b1 b2 b3", 2), ("b4 b5", 2)]
