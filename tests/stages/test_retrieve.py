"""The retrieve stage over a fake index (the real FAISS index: tests/store and tests/serving)."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.context import RequestContext
from pipeline.errors import SpecError
from pipeline.events import Done
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from stages.audit import AuditConfig, build_record
from tests.fakes import FakeEngine, FakeEngines, FakeIndex

CATALOG = Catalog(models={"smol": ModelInfo("smol")}, indexes=frozenset({"handbook"}))


def build(registry, retrieve: str, extra: str = "", index=None):
    yaml_text = f"""
    name: rag
    stages:
      - {{id: context, type: retrieve, with: {retrieve}}}
      - {{id: prompt, type: prompt{extra}}}
    """
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "rag.yaml", registry, CATALOG)
    engines = FakeEngines(smol=FakeEngine())
    return Pipeline(loaded, Resources(CATALOG, engines=engines, indexes={"handbook": index or FakeIndex()}))


async def test_documents_are_retrieved_recorded_and_placed_in_the_prompt(registry):
    index = FakeIndex()
    pipeline = build(registry, "{index: handbook, top_k: 3, min_score: 0.3, filters: {path: 'b*'}}", index=index)
    ctx = RequestContext.from_text("rag", "How much is Plus?")
    final = await Runner().run(pipeline, ctx)
    assert isinstance(final, Done)
    where = {"and": [{"field": "path", "op": "glob", "value": ["b*"]}]}
    assert index.calls == [("How much is Plus?", 3, 0.3, where)]
    assert [(d.id, d.source, d.title, d.score) for d in ctx.documents] == [
        ("billing#3", "billing.md", "Billing", 0.81), ("refunds#9", "refunds.md", "Refunds", 0.42)]
    entry = {"index": "handbook", "version": "v7", "mode": "dense", "ids": ["billing#3", "refunds#9"],
             "scores": [0.81, 0.42], "dense": {"ids": ["billing#3", "refunds#9"], "scores": [0.81, 0.42]},
             "keyword": {"ids": [], "scores": []}}
    assert ctx.facts["retrieval"] == {**entry, "steps": {"context": entry}}
    assert ctx.facts["decisions"]["context"] == {"documents": 2, "mode": "dense", "filtered_on": ["path"]}
    system = ctx.messages[0].content
    assert "[1] Billing (billing.md)\nPlus costs $8." in system and "[2] Refunds" in system
    assert build_record(ctx, AuditConfig())["retrieval"]["ids"] == ["billing#3", "refunds#9"]


async def test_the_query_is_a_template(registry):
    index = FakeIndex()
    pipeline = build(registry, "{index: handbook, query: 'Lumen {{ tags.product }}: {{ input }}'}", index=index)
    await Runner().run(pipeline, RequestContext.from_text("rag", "price?", tags={"product": "Plus"}))
    assert index.calls[0][0] == "Lumen Plus: price?"


async def test_the_document_budget_keeps_the_best_ranked_that_fit(registry):
    # ByteTokenizer: one token per byte; "Plus costs $8." is 14 tokens, the refund text 23.
    pipeline = build(registry, "{index: handbook}", extra=", with: {max_document_tokens: 20}")
    ctx = RequestContext.from_text("rag", "How much is Plus?")
    await Runner().run(pipeline, ctx)
    assert [d.id for d in ctx.documents] == ["billing#3"]
    assert ctx.facts["decisions"]["prompt"] == {"documents_used": 1, "documents_dropped": 1, "document_tokens": 14}


async def test_an_index_that_is_not_built_fails_clearly(registry):
    yaml_text = "name: rag\nstages:\n  - {id: context, type: retrieve, with: {index: handbook}}\n"
    loaded = load_pipeline_text(yaml_text, "rag.yaml", registry, CATALOG)
    final = await Runner().run(Pipeline(loaded, Resources(CATALOG)), RequestContext.from_text("rag", "hi"))
    assert final.kind == "backend_error" and "inferline index build" in final.message


@pytest.mark.parametrize(("with_", "message"), [
    ("{index: handbok}", "unknown index 'handbok'; did you mean 'handbook'?"),
    ("{index: handbook, top_k: 0}", "top_k"),
    ("{index: handbook, query: '{{ nothing }}'}", "unknown field 'nothing'"),
    ("{index: handbook, filters: {author: x}}", "filters"),
])
def test_configuration_errors_are_located(registry, with_, message):
    yaml_text = f"name: rag\nstages:\n  - {{id: context, type: retrieve, with: {with_}}}\n"
    with pytest.raises(SpecError) as caught:
        load_pipeline_text(yaml_text, "rag.yaml", registry, CATALOG)
    assert str(caught.value).startswith("rag.yaml:3:") and message in str(caught.value)
