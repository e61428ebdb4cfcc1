"""The retrieve stage's modes, fusion record, filters (checked at load, templated per request) and rerank."""

from __future__ import annotations

import textwrap

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import tracing
from pipeline.context import Principal, RequestContext
from pipeline.errors import SpecError
from pipeline.events import Done
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, Resources
from pipeline.runner import Pipeline, Runner
from stages.audit import AuditConfig, build_record
from stages.filters import FilterError, parse
from tests.fakes import FakeIndex

FIELDS = {"tenant": "string", "updated": "date", "version": "number", "tags": "list"}
CATALOG = Catalog(indexes=frozenset({"handbook"}), index_fields={"handbook": FIELDS})


def load(registry, retrieve: str, catalog: Catalog = CATALOG):
    yaml_text = f"""
    name: rag
    stages:
      - id: context
        type: retrieve
        with: {retrieve}
    """
    return load_pipeline_text(textwrap.dedent(yaml_text), "rag.yaml", registry, catalog)


@pytest.mark.parametrize(("filters", "located", "message"), [
    ("{tenantt: acme}", "with.filters.tenantt", "unknown field 'tenantt'; did you mean 'tenant'?"),
    ("{version: {gte: new}}", "with.filters.version.gte", "expected a number, got 'new'"),
    ("{updated: {after: 2025-01-01}}", "with.filters.updated.after", "unknown operator 'after'"),
    ("{tenant: {gte: a}}", "with.filters.tenant.gte", "ranges need a number or date field"),
    ("{or: [{tenant: a}, {colour: red}]}", "with.filters.or[1].colour", "unknown field 'colour'"),
    ("{tenant: '{{ nonsense }}'}", "with.filters.tenant", "template names unknown field 'nonsense'"),
])
def test_a_bad_filter_is_a_located_load_error(registry, filters, located, message):
    with pytest.raises(SpecError) as err:
        load(registry, f"{{index: handbook, filters: {filters}}}")
    text = str(err.value)
    assert "rag.yaml:" in text and located in text and message in text, text


def test_the_filter_language_parses_to_typed_conditions():
    where = parse({"tenant": "acme", "tags": ["billing", "plans"], "version": {"gte": 4, "lt": "5"},
                   "updated": {"gte": "2025-01-01"}, "path": "billing*"}, {**FIELDS, "path": "string"})
    assert where.render({}) == {"and": [
        {"field": "tenant", "op": "eq", "value": "acme"},
        {"field": "tags", "op": "in", "value": ["billing", "plans"]},
        {"field": "version", "op": "range", "value": {"gte": 4, "lt": 5.0}},
        {"field": "updated", "op": "range", "value": {"gte": "2025-01-01"}},
        {"field": "path", "op": "glob", "value": ["billing*"]}]}
    with pytest.raises(FilterError):
        parse({"updated": "not a date"}, FIELDS)


async def test_hybrid_options_reach_the_index_and_each_side_is_recorded(registry):
    index = FakeIndex()
    loaded = load(registry, "{index: handbook, mode: hybrid, fusion: weighted, weights: {keyword: 2}, "
                            "candidates: 20, filters: {tenant: '{{ tenant }}'}}")
    ctx = RequestContext.from_text("rag", "price?", principal=Principal("k1", "caller", "acme"))
    final = await Runner().run(Pipeline(loaded, Resources(CATALOG, indexes={"handbook": index})), ctx)
    assert isinstance(final, Done)
    assert index.options == [{"mode": "hybrid", "where": {"and": [{"field": "tenant", "op": "eq", "value": "acme"}]},
                              "fusion": "weighted", "rrf_k": 60, "weights": {"keyword": 2.0}, "candidates": 20}]
    assert ctx.facts["decisions"]["context"]["filtered_on"] == ["tenant"]
    assert "acme" not in str(ctx.facts["decisions"])  # the value may be the request's: the audit keeps the field


# --- the real index --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_index(tmp_path_factory):
    from store.embeddings import shared_embedder
    from store.vector_index import IndexSettings, VectorStore
    from tests.store.test_hybrid import TENANT_META, TENANTS, write_docs

    root = tmp_path_factory.mktemp("tenants")
    docs = write_docs(root / "docs", TENANTS, TENANT_META)
    return VectorStore.build(root / "index", "handbook", docs, IndexSettings(), shared_embedder(),
                             fields={"tenant": "string", "updated": "date", "version": "number"})


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
async def test_one_index_serves_many_tenants_without_a_leak(registry, tenant_index, mode):
    catalog = Catalog(indexes=frozenset({"handbook"}), index_fields={"handbook": FIELDS})
    loaded = load(registry, f"{{index: handbook, top_k: 4, mode: {mode}, filters: {{tenant: '{{{{ tenant }}}}'}}}}",
                  catalog)
    pipeline = Pipeline(loaded, Resources(catalog, indexes={"handbook": tenant_index}))
    seen = {}
    for tenant in ("acme", "globex", ""):
        principal = Principal("k", "caller", tenant) if tenant else None
        ctx = RequestContext.from_text("rag", "Plus plan price per month, and the command palette shortcut",
                                       principal=principal)
        assert isinstance(await Runner().run(pipeline, ctx), Done)
        seen[tenant] = {d.source.split("-")[0] for d in ctx.documents}
        record = build_record(ctx, AuditConfig())["retrieval"]
        assert {i.split("-")[0] for i in record["ids"] + record["dense"]["ids"] + record["keyword"]["ids"]} <= \
            ({tenant} if tenant else set())
    assert seen == {"acme": {"acme"}, "globex": {"globex"}, "": set()}


@pytest.mark.slow
async def test_the_trace_and_audit_record_show_both_sides_and_the_fused_order(registry, tenant_index):
    loaded = load(registry, "{index: handbook, top_k: 2, rrf_k: 10}")
    pipeline = Pipeline(loaded, Resources(CATALOG, indexes={"handbook": tenant_index}))
    ctx = RequestContext.from_text("rag", "command palette Ctrl+Shift+K")
    exporter = InMemorySpanExporter()
    provider = tracing.make_tracer_provider("none")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await Runner(provider.get_tracer("test")).run(pipeline, ctx)
    provider.shutdown()
    record = build_record(ctx, AuditConfig())["retrieval"]
    assert record["mode"] == "hybrid" and record["version"] == tenant_index.version
    assert record["dense"]["ids"] and record["keyword"]["ids"][0] == "globex-shortcuts#3"
    assert record["fused"]["ids"][:2] == record["ids"] == [d.id for d in ctx.documents]
    expected = {}
    for side in ("dense", "keyword"):
        for rank, chunk in enumerate(record[side]["ids"], start=1):
            expected[chunk] = expected.get(chunk, 0) + 1 / (10 + rank)
    assert record["fused"]["scores"][0] == pytest.approx(max(expected.values()), abs=1e-6)
    attributes = {span.name: span for span in exporter.get_finished_spans()}["stage context"].attributes
    assert attributes["inferline.retrieval.mode"] == "hybrid"
    assert list(attributes["inferline.retrieval.keyword.ids"]) == record["keyword"]["ids"]
    assert list(attributes["inferline.retrieval.dense.ids"]) == record["dense"]["ids"]


@pytest.mark.slow
async def test_a_pdf_passage_is_cited_with_its_page(registry, tmp_path):
    from store.embeddings import shared_embedder
    from store.vector_index import IndexSettings, VectorStore
    from tests.store.test_documents import write_pdf

    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "guide.pdf", ["Domains are verified with a DNS TXT record. " * 30,
                                   "SCIM tokens are valid for one year. " * 30], "Admin guide")
    index = VectorStore.build(tmp_path / "index", "handbook", docs, IndexSettings(chunk_tokens=64, overlap=8),
                              shared_embedder())
    yaml_text = """
    name: rag
    stages:
      - {id: context, type: retrieve, with: {index: handbook, top_k: 1}}
      - {id: prompt, type: prompt}
    """
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "rag.yaml", registry, CATALOG)
    ctx = RequestContext.from_text("rag", "How long is a SCIM token valid?")
    assert isinstance(await Runner().run(Pipeline(loaded, Resources(CATALOG, indexes={"handbook": index})), ctx),
                      Done)
    assert ctx.documents[0].page == 2
    assert "[1] Admin guide (guide.pdf, p. 2)" in ctx.messages[0].content
