"""An agent step's ``pipeline`` tools are checked with the set of pipelines served together
(serving/runtime/pipeline_set.py): served beside it, never the pipeline itself."""

from __future__ import annotations

from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo
from serving.runtime.pipeline_set import PipelineSet

CATALOG = Catalog(models={"smol": ModelInfo("smol")})
AGENT = """name: {name}
stages:
  - id: answer
    type: agent
    with:
      tools: [{{kind: pipeline, name: ask, pipeline: {target}}}]
"""
FAQ = "name: faq\nstages:\n  - {id: answer, type: llm}\n"


def load(registry, text: str, file: str):
    return load_pipeline_text(text, file, registry, CATALOG)


def test_a_pipeline_tool_must_be_served_beside_it(registry):
    agent = load(registry, AGENT.format(name="orders", target="fqa"), "orders.yaml")
    faq = load(registry, FAQ, "faq.yaml")
    [issue] = PipelineSet.of([agent, faq]).issues
    assert (issue.file, issue.line, issue.loc) == ("orders.yaml", 6, "stages[0].with.tools[0].pipeline")
    assert "no pipeline 'fqa' is served beside it" in issue.message and "did you mean 'faq'" in issue.message
    assert PipelineSet.of([load(registry, AGENT.format(name="orders", target="faq"), "orders.yaml"), faq]).issues == []


def test_a_pipeline_cannot_be_its_own_tool(registry):
    [issue] = PipelineSet.of([load(registry, AGENT.format(name="orders", target="orders"), "orders.yaml")]).issues
    assert "cannot be a tool of its own agent step" in issue.message
