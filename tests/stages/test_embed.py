"""The embed stage over a fake embedding backend (the real model: tests/serving/http/test_embeddings_routes.py)."""

from __future__ import annotations

import hashlib
import json
import textwrap

import numpy as np
import pytest

from pipeline.context import ChatMessage, RequestContext
from pipeline.cost import Price
from pipeline.errors import SpecError
from pipeline.events import Done, Error
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, Embeddings, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from stages.audit import AuditConfig, build_record

CATALOG = Catalog(embedding_models={"minilm": ModelInfo("minilm", Price(input_per_1k=2.0))})


class FakeBackend:
    """Vectors ``[len(text), index-in-call, 0]``; one token per character."""

    name = "minilm"
    dimensions = 3
    max_input_tokens = 50

    def __init__(self):
        self.calls: list[list[str]] = []

    async def embed(self, texts):
        self.calls.append(list(texts))
        vectors = np.array([[len(t), i, 0] for i, t in enumerate(texts)], dtype=np.float32)
        return Embeddings(vectors, tuple(len(t) for t in texts))


class FakeEmbedders:
    def __init__(self, backend):
        self.backend = backend

    async def get(self, name):
        return self.backend


def build(registry, backend, stage="{model: minilm}", catalog=CATALOG):
    text = f"""
    name: vectors
    stages:
      - {{id: vec, type: embed, with: {stage}}}
    """
    loaded = load_pipeline_text(textwrap.dedent(text), "vectors.yaml", registry, catalog)
    return Pipeline(loaded, Resources(catalog, embedders=FakeEmbedders(backend)))


def request(*texts, **kwargs):
    return RequestContext(pipeline="vectors", input_messages=[ChatMessage("user", t) for t in texts], **kwargs)


async def test_each_user_message_is_one_text_embedded_in_order_with_usage_and_cost(registry):
    backend = FakeBackend()
    ctx = request("a", "bbb", "cc")
    ctx.input_messages.insert(0, ChatMessage("system", "not embedded"))
    final = await Runner().run(build(registry, backend), ctx)
    assert isinstance(final, Done)
    assert backend.calls == [["a", "bbb", "cc"]]
    assert ctx.embeddings is not None and ctx.embeddings.vectors[:, 0].tolist() == [1, 3, 2]
    assert ctx.usage.input_tokens == 6 and ctx.model == ""  # the generating model's field: not this one
    assert ctx.ledger.stage_total("vec") == pytest.approx(6 * 2.0 / 1000)
    assert ctx.facts["embedding"] == {"model": "minilm", "inputs": 3, "tokens": 6, "dimensions": 3}


@pytest.mark.parametrize(("dimensions", "ok"), [(None, True), (3, True), (2, False)])
async def test_dimensions_other_than_the_models_are_refused(registry, dimensions, ok):
    ctx = request("x", params={} if dimensions is None else {"dimensions": dimensions})
    final = await Runner().run(build(registry, FakeBackend()), ctx)
    assert isinstance(final, Done) is ok
    if not ok:
        assert isinstance(final, Error) and final.kind == "invalid_input"
        assert final.message.startswith("dimensions: model 'minilm' makes 3-dimensional vectors only")


async def test_more_texts_than_the_stage_allows_are_refused_before_the_model(registry):
    backend = FakeBackend()
    final = await Runner().run(build(registry, backend, "{model: minilm, max_inputs: 2}"), request("a", "b", "c"))
    assert isinstance(final, Error) and "3 texts, over this pipeline's limit of 2" in final.message
    assert backend.calls == []


def test_an_unknown_embedding_model_is_a_load_error(registry):
    with pytest.raises(SpecError, match=r"unknown embedding model 'minlm'; did you mean 'minilm'\? "
                                        r"\(embedding_models in inferline.yaml: minilm\)"):
        build(registry, FakeBackend(), "{model: minlm}")


@pytest.mark.parametrize("mode", ["full", "hash"])
async def test_the_audit_record_holds_the_texts_never_the_vectors(registry, mode):
    ctx = request("first", "second")
    ctx.facts["input_texts"] = ["first", "second"]
    await Runner().run(build(registry, FakeBackend()), ctx)
    record = build_record(ctx, AuditConfig(content=mode))
    sent = json.dumps(["first", "second"])
    expected = sent if mode == "full" else hashlib.sha256(sent.encode()).hexdigest()
    assert (record["input_content"], record["output_content"]) == (expected, "")
    assert (record["input_tokens"], record["output_tokens"], record["model"]) == (11, 0, "minilm")
