"""What the HTTP routes ask of a pipeline (issue 60, item 8): the same answers for a chain and for a workflow
whose answering step is an ``llm`` step, read from the step types' declarations rather than their names."""

from __future__ import annotations

import dataclasses
import textwrap

from pipeline.context import RequestContext
from pipeline.loader import load_pipeline_text
from pipeline.protocols import ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from tests.fakes import FakeEngine, FakeEngines

CHAIN = """
name: chain
stages:
  - {id: prompt, type: prompt, with: {system: "You are terse."}}
  - {id: tok, type: tokenize, with: {model: big}}
  - {id: gen, type: generate}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""

WORKFLOW = """
name: flow
stages:
  - {id: classify, type: llm, with: {model: smol, system: "Classify."}}
  - {id: answer, type: llm, with: {model: big, system: "Answer kindly: {{ steps.classify.output }}."}}
  - {id: log, type: audit, always: true}
"""

EMBED = """
name: vectors
stages:
  - {id: vectors, type: embed, with: {model: minilm}}
"""


def build(text: str, registry, catalog) -> Pipeline:
    return Pipeline(load_pipeline_text(textwrap.dedent(text), "t.yaml", registry, catalog))


def test_a_chain_answers_through_its_stream_stage_on_its_tokenize_model(registry, catalog):
    chain = build(CHAIN, registry, catalog)
    assert chain.answer_steps == {"out"} and chain.answer_model == "big" and not chain.embeds
    assert chain.submit_steps == {"gen"}  # a streamed response may start once it handed the prompt over
    prompt = chain.prompt_for(RequestContext.from_text("chain", "hi"))
    assert [(m.role, m.content) for m in prompt] == [("system", "You are terse."), ("user", "hi")]


def test_a_workflow_answers_through_its_answering_llm_step(registry, catalog):
    flow = build(WORKFLOW, registry, catalog)
    assert flow.answer_steps == {"answer"} and flow.answer_model == "big" and flow.embedding_model is None
    assert flow.submit_steps == frozenset()  # an llm step reads its own tokens: its first text starts a stream
    prompt = flow.prompt_for(RequestContext.from_text("flow", "hi"))
    assert [(m.role, m.content) for m in prompt] == [("system", "Answer kindly: ."), ("user", "hi")]  # no steps ran


def test_an_embedding_pipeline_names_its_model(registry, catalog):
    catalog = dataclasses.replace(catalog, embedding_models={"minilm": ModelInfo("minilm")})
    vectors = build(EMBED, registry, catalog)
    assert vectors.embeds and vectors.embedding_model == "minilm"
    assert vectors.answer_model is None and vectors.prompt_for(RequestContext.from_text("vectors", "hi")) is None


async def test_the_answers_last_token_is_when_its_answering_step_ended(registry, catalog):
    """What inter-token latency is measured to (serving/runtime/slo.py): a workflow's answering llm step's end."""
    loaded = load_pipeline_text(textwrap.dedent(WORKFLOW), "t.yaml", registry, catalog)
    engine = FakeEngine("Fine, thanks.")
    flow = Pipeline(loaded, Resources(catalog, engines=FakeEngines(smol=engine, big=engine)))
    final = await Runner().run(flow, RequestContext.from_text("flow", "hi"))
    answer = next(s for s in final.summary.stages if s.id == "answer")
    assert final.summary.last_token_s == answer.started_s + answer.duration_s
