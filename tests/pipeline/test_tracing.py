"""The span tree and costs, through OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import textwrap

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pipeline import tracing
from pipeline.context import RequestContext
from pipeline.loader import load_pipeline_text
from pipeline.runner import Pipeline, Runner

PIPELINE = """
name: traced
version: "7"
stages:
  - {id: pick, type: pick, with: {default: smol}}
  - {id: a, type: record, with: {cost_usd: 0.002}}
  - {id: skipped, type: record, when: "role == 'admin'"}
  - {id: bad, type: fail, on_error: skip}
  - {id: echo, type: echo}
"""


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def runner(exporter):
    provider = tracing.make_tracer_provider("none")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Runner(provider.get_tracer("test"))
    provider.shutdown()


async def test_span_tree_and_costs(registry, catalog, runner, exporter):
    pipeline = Pipeline(load_pipeline_text(textwrap.dedent(PIPELINE), "t.yaml", registry, catalog))
    final = await runner.run(pipeline, RequestContext.from_text("traced", "hi there"))
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"pipeline traced", "stage pick", "stage a", "stage bad", "stage echo"}
    root = spans["pipeline traced"]
    assert root.parent is None
    for name in ("stage pick", "stage a", "stage bad", "stage echo"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    assert format(root.context.trace_id, "032x") == final.summary.trace_id
    assert root.attributes[tracing.PIPELINE_NAME] == "traced"
    assert root.attributes[tracing.PIPELINE_VERSION] == "7"
    assert root.attributes[tracing.COST_USD] == pytest.approx(0.002)
    assert spans["stage a"].attributes[tracing.COST_USD] == pytest.approx(0.002)
    assert spans["stage a"].attributes[tracing.STAGE_TYPE] == "record"
    assert spans["stage pick"].attributes[tracing.GEN_AI_REQUEST_MODEL] == "smol"
    bad = spans["stage bad"]
    assert bad.status.status_code == StatusCode.ERROR
    assert bad.attributes[tracing.STAGE_STATUS] == "failed"
    assert [e.name for e in bad.events] == ["exception"]
    assert final.summary.cost_usd == pytest.approx(0.002)


async def test_failed_request_marks_the_root_span(registry, runner, exporter):
    pipeline = Pipeline(load_pipeline_text("name: t\nstages: [{id: bad, type: fail}]\n", "t.yaml", registry))
    await runner.run(pipeline, RequestContext.from_text("t", "x"))
    root = next(s for s in exporter.get_finished_spans() if s.name == "pipeline t")
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes[tracing.REQUEST_STATUS] == "failed"


def test_exporter_choices():
    assert tracing.make_tracer_provider("console") is not None
    assert tracing.make_tracer_provider("otlp", "http://127.0.0.1:4318/v1/traces") is not None
    with pytest.raises(ValueError, match="unknown telemetry exporter 'jaeger'"):
        tracing.make_tracer_provider("jaeger")


async def test_without_an_exporter_spans_are_not_recorded_but_every_request_has_its_own_trace_id(registry):
    provider = tracing.make_tracer_provider("none")
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("pipeline t") as root, tracer.start_as_current_span("stage a") as child:
        assert not root.is_recording() and not child.is_recording()
        assert child.get_span_context().trace_id == root.get_span_context().trace_id
    pipeline = Pipeline(load_pipeline_text("name: t\nstages: [{id: a, type: record}]\n", "t.yaml", registry))
    runner = Runner(tracer)
    ids = {(await runner.run(pipeline, RequestContext.from_text("t", "x"))).summary.trace_id for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) != 0 for i in ids)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # from now on spans go somewhere: recorded
    await runner.run(pipeline, RequestContext.from_text("t", "x"))
    assert {span.name for span in exporter.get_finished_spans()} == {"pipeline t", "stage a"}


async def test_stage_spans_are_made_only_when_the_request_span_records(registry):
    class Counting:
        """The tracer, counting the spans asked of it."""

        def __init__(self, tracer):
            self.tracer, self.names = tracer, []

        def start_as_current_span(self, name, **kwargs):
            self.names.append(name)
            return self.tracer.start_as_current_span(name, **kwargs)

    provider = tracing.make_tracer_provider("none")
    tracer = Counting(provider.get_tracer("test"))
    pipeline = Pipeline(load_pipeline_text("name: t\nstages: [{id: a, type: record}, {id: b, type: echo}]\n",
                                           "t.yaml", registry))
    runner = Runner(tracer)
    final = await runner.run(pipeline, RequestContext.from_text("t", "x"))
    assert tracer.names == ["pipeline t"]  # nothing records: no stage spans
    assert [s.status for s in final.summary.stages] == ["ok", "ok"]
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer.names.clear()
    await runner.run(pipeline, RequestContext.from_text("t", "x"))
    assert tracer.names == ["pipeline t", "stage a", "stage b"]
