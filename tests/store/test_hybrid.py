"""Keyword and hybrid search, fusion, metadata filters inside the search, and documents that go away."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from store.fusion import reciprocal_rank_fusion, weighted_fusion
from store.keyword_index import KeywordIndex
from store.metadata_filter import matches
from store.vector_index import IndexSettings, VectorStore

# --- without the embedding model ------------------------------------------------------


def test_reciprocal_rank_fusion_on_a_fixed_example():
    dense = [(1, 0.9), (2, 0.8), (3, 0.7)]
    keyword = [(3, 12.0), (4, 9.0), (1, 2.0)]
    fused = reciprocal_rank_fusion({"dense": dense, "keyword": keyword}, k=60)
    # 1: 1/61 + 1/63; 3: 1/63 + 1/61 (a tie, broken by best rank, then row); 2: 1/62; 4: 1/62 (tie: row)
    assert [row for row, _ in fused] == [1, 3, 2, 4]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 63)
    assert fused[2][1] == pytest.approx(1 / 62)
    weighted = reciprocal_rank_fusion({"dense": dense, "keyword": keyword}, k=60, weights={"keyword": 2.0})
    assert [row for row, _ in weighted] == [3, 1, 4, 2]


def test_weighted_fusion_keeps_how_far_ahead_the_first_is():
    dense = [(1, 0.9), (2, 0.85), (3, 0.1)]
    keyword = [(3, 10.0), (2, 9.9), (1, 0.0)]
    fused = dict(weighted_fusion({"dense": dense, "keyword": keyword}))
    assert fused[2] == pytest.approx(0.9375 + 0.99) and fused[2] > fused[1] and fused[2] > fused[3]


def test_bm25_matches_words_by_their_stem_and_codes_exactly():
    index = KeywordIndex.build(["Refunds are paid within ten days.", "The part LX-4410 is a dock.",
                                "Nothing relevant here."])
    rows, _ = index.search("refunded", 3)
    assert list(rows) == [0]
    rows, _ = index.search("LX-4410", 3)
    assert list(rows) == [1]
    rows, _ = index.search("LX-4410", 3, mask=[True, False, True])
    assert list(rows) == []


@pytest.mark.parametrize(("where", "expected"), [
    ({"field": "tenant", "op": "eq", "value": "acme"}, True),
    ({"field": "tenant", "op": "in", "value": ["globex", "acme"]}, True),
    ({"field": "version", "op": "range", "value": {"gte": 4, "lt": 5}}, True),
    ({"field": "updated", "op": "range", "value": {"gt": "2025-03-01"}}, False),
    ({"field": "tags", "op": "eq", "value": "billing"}, True),
    ({"or": [{"field": "tenant", "op": "eq", "value": "x"}, {"field": "missing", "op": "eq", "value": 1}]}, False),
    ({"field": "version", "op": "eq", "value": "4"}, False),  # a string is not the number 4
])
def test_filters_evaluate_typed_values(where, expected):
    values = {"tenant": "acme", "version": 4, "updated": "2025-03-01", "tags": ["billing", "plans"]}
    assert matches(where, values) is expected


# --- the real embedding model -----------------------------------------------------------


@pytest.fixture(scope="module")
def embedder():
    from store.embeddings import shared_embedder

    return shared_embedder()


PRODUCTS = {
    "dock.md": "# Desk dock\n\nThe desk dock charges a laptop and connects two monitors. Part number QZ-7731.",
    "camera.md": "# Meeting camera\n\nThe meeting camera films a whole room in 4K. Part number QZ-7713.",
    "headset.md": "# Headset\n\nThe wireless headset lasts 30 hours. Part number QZ-1377.",
    "keyboard.md": "# Keyboard\n\nThe keyboard has backlit keys. Part number QZ-3177.",
    "mouse.md": "# Mouse\n\nThe mouse has six buttons. Part number QZ-7371.",
}

TENANTS = {
    "acme-plans.md": "# Pricing\n\nOur Plus tier is billed at eight dollars a seat.",
    "globex-plans.md": "# How much the Plus plan costs\n\nThe Plus plan costs eight dollars per user per month.",
    "globex-old.md": "# Plans (2023)\n\nThe Plus plan cost six dollars per user per month.",
    "globex-shortcuts.md": "# Shortcuts\n\nPress Ctrl+Shift+K to open the command palette.",
}
TENANT_META = {"acme-plans.md": {"tenant": "acme", "updated": "2025-02-01", "version": 5},
               "globex-plans.md": {"tenant": "globex", "updated": "2025-03-01", "version": 5},
               "globex-old.md": {"tenant": "globex", "updated": "2023-01-10", "version": 3},
               "globex-shortcuts.md": {"tenant": "globex", "updated": "2024-06-01", "version": 4}}
FIELDS = {"tenant": "string", "updated": "date", "version": "number"}


def write_docs(folder: Path, pages: dict[str, str], metadata: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (folder / name).write_text(text)
    if metadata:
        (folder / "metadata.json").write_text(json.dumps(metadata))
    return folder


@pytest.mark.slow
def test_bm25_finds_an_exact_product_code_that_dense_search_misses(tmp_path, embedder):
    docs = write_docs(tmp_path / "docs", PRODUCTS)
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(), embedder)
    assert store.default_mode == "hybrid"
    dense = store.retrieve("QZ-7731", 1, mode="dense")
    keyword = store.retrieve("QZ-7731", 1, mode="keyword")
    assert dense.hits[0].doc_id != "dock"  # the embedding blurs the code with its neighbours
    assert keyword.hits[0].doc_id == "dock"
    hybrid = store.retrieve("QZ-7731", 2)
    assert hybrid.mode == "hybrid" and "dock" in [h.doc_id for h in hybrid.hits]
    # each side's candidates are kept for the trace, and the fused order is the hits'
    assert hybrid.keyword[0][0].startswith("dock#") and len(hybrid.dense) == len(PRODUCTS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_filters_apply_inside_the_search_before_top_k(tmp_path, embedder, mode):
    docs = write_docs(tmp_path / "docs", TENANTS, TENANT_META)
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(), embedder, fields=FIELDS)
    question = "How much does the Plus plan cost per user per month?"
    # acme's page is not the best match overall; filtered after a top 1 it would be lost
    assert store.retrieve(question, 1, mode=mode).hits[0].doc_id != "acme-plans"
    acme = store.retrieve(question, 1, mode=mode, where={"field": "tenant", "op": "eq", "value": "acme"})
    assert [h.doc_id for h in acme.hits] == ["acme-plans"]
    old = store.retrieve(question, 3, mode=mode, where={"and": [
        {"field": "tenant", "op": "in", "value": ["globex"]},
        {"field": "updated", "op": "range", "value": {"lt": "2024-01-01"}}]})
    assert [h.doc_id for h in old.hits] == ["globex-old"]
    versions = store.retrieve(question, 4, mode="dense", where={"field": "version", "op": "range",
                                                                  "value": {"gte": 4}})
    assert {h.doc_id for h in versions.hits} == {"acme-plans", "globex-plans", "globex-shortcuts"}
    assert store.retrieve(question, 4, mode=mode, where={"field": "tenant", "op": "eq", "value": "nobody"}).hits == []


@pytest.mark.slow
def test_index_add_removes_the_chunks_of_files_that_are_gone(tmp_path, embedder):
    docs = write_docs(tmp_path / "docs", PRODUCTS)
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(), embedder)
    (docs / "dock.md").unlink()
    kept, changes = store.add(docs, keep_missing=True)
    assert changes["removed"] == [] and "dock" in kept.manifest["documents"]
    new, changes = kept.add(docs)
    assert changes["removed"] == ["dock"] and changes["unchanged"] == ["camera", "headset", "keyboard", "mouse"]
    assert "dock" not in new.manifest["documents"] and all(c.doc_id != "dock" for c in new.chunks)
    assert all(h.doc_id != "dock" for h in new.retrieve("QZ-7731 desk dock", 5).hits)
    reopened = VectorStore.open(tmp_path / "index", embedder)
    assert reopened.version == new.version and reopened.keywords.size == len(reopened.chunks) == 4
    assert reopened.retrieve("QZ-7713", 1, mode="keyword").hits[0].doc_id == "camera"  # BM25 rebuilt with it


@pytest.mark.slow
def test_index_remove_takes_out_a_document_by_id_or_path(tmp_path, embedder):
    docs = write_docs(tmp_path / "docs", PRODUCTS)
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(), embedder)
    new = store.remove(["dock", "camera.md"])
    assert sorted(new.manifest["documents"]) == ["headset", "keyboard", "mouse"]
    with pytest.raises(KeyError, match="no document 'nope'"):
        new.remove(["nope"])


@pytest.mark.slow
def test_a_pdf_chunk_cites_its_page_and_a_docx_table_is_searchable(tmp_path, embedder):
    from tests.store.test_documents import write_docx, write_pdf

    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "guide.pdf", ["Domains are verified with a DNS TXT record. " * 30,
                                   "SCIM tokens are valid for one year. " * 30], "Admin guide")
    write_docx(docs / "prices.docx")
    (docs / "broken.pdf").write_bytes(b"%PDF-1.4 broken")
    store = VectorStore.build(tmp_path / "index", "kb", docs, IndexSettings(chunk_tokens=64, overlap=8), embedder)
    assert [path for path, _ in store.skipped] == ["broken.pdf"]
    scim = store.retrieve("How long is a SCIM token valid?", 1).hits[0]
    assert (scim.source, scim.page) == ("guide.pdf", 2)
    dns = store.retrieve("How is a domain verified?", 1).hits[0]
    assert (dns.source, dns.page) == ("guide.pdf", 1)
    camera = store.retrieve("LX-7720", 1, mode="keyword").hits[0]
    assert camera.source == "prices.docx" and "Meeting camera | $349" in camera.text
