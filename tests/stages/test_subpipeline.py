"""The ``pipeline`` step over a fake caller: the callee's answer, its steps nested, its cost counted, denials."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.context import Principal, RequestContext
from pipeline.cost import Price
from pipeline.errors import PolicyDenied, SpecError
from pipeline.events import Done, Error
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from tests.fakes import FakeEngine, FakeEngines

CATALOG = Catalog(models={"smol": ModelInfo("smol", price=Price(input_per_1k=1.0, output_per_1k=1.0))})
CALLEE = """
name: inner
access: {roles: [admin]}
stages:
  - {id: answer, type: llm, with: {system: "Inner.", max_tokens: 16}}
  - {id: log, type: audit, always: true}
"""
CALLER = """
name: outer
stages:
  - id: call
    type: pipeline
    with: {pipeline: "inner@1", input: "about {{ input }}", tags: {tier: gold}}
  - {id: polish, type: llm, with: {system: "Polish: {{ steps.call.output }}", max_tokens: 16}}
"""


class Caller:
    """Runs the callee in-process as the server's caller does, checking its roles."""

    def __init__(self, registry, sink):
        self.callee = Pipeline(load_pipeline_text(textwrap.dedent(CALLEE), "inner.yaml", registry, CATALOG),
                               Resources(CATALOG, engines=FakeEngines(smol=FakeEngine("inner says hi")), audit=sink))
        self.calls: list[tuple[str, str | None, RequestContext]] = []

    async def call_nested(self, pipeline, version, ctx, on_text=None, on_step=None):
        self.calls.append((pipeline, version, ctx))
        if ctx.principal is not None and ctx.principal.role not in self.callee.spec.access.roles:
            raise PolicyDenied(f"pipeline {pipeline!r} does not let role {ctx.principal.role!r} call it",
                               rule="access.roles", category="auth")
        return await Runner().run(self.callee, ctx)


class Sink:
    def __init__(self):
        self.records = []

    async def write(self, record):
        self.records.append(record)


def outer(registry, caller) -> Pipeline:
    loaded = load_pipeline_text(textwrap.dedent(CALLER), "outer.yaml", registry, CATALOG)
    return Pipeline(loaded, Resources(CATALOG, engines=FakeEngines(smol=FakeEngine("polished")), pipelines=caller))


async def test_a_sub_pipelines_answer_steps_and_cost_nest_under_its_step(registry):
    sink = Sink()
    caller = Caller(registry, sink)
    ctx = RequestContext.from_text("outer", "refunds", principal=Principal("k1", "admin"))
    final = await Runner().run(outer(registry, caller), ctx)
    assert isinstance(final, Done) and final.summary.output_text == "polished"
    name, version, child = caller.calls[0]
    assert (name, version, child.input, child.tags) == ("inner", "1", "about refunds", {"tier": "gold"})
    assert child.parent_request == ctx.request_id and child.principal == ctx.principal
    assert ctx.steps["call"]["output"] == "inner says hi"
    assert [(r.id, r.parent) for r in ctx.stages] == [("answer", "call"), ("log", "call"), ("call", ""),
                                                      ("polish", "")]
    assert not sink.records  # the callee's audit step writes no record of its own
    inner_cost = child.ledger.total_usd
    assert inner_cost > 0 and ctx.ledger.stage_total("call") == pytest.approx(inner_cost)
    assert ctx.usage.output_tokens == child.usage.output_tokens + len("polished")


async def test_the_callees_roles_apply_to_the_callers_key(registry):
    caller = Caller(registry, Sink())
    ctx = RequestContext.from_text("outer", "refunds", principal=Principal("k2", "caller"))
    final = await Runner().run(outer(registry, caller), ctx)
    assert isinstance(final, Error) and final.status == "denied" and "role 'caller'" in final.message


def test_a_callee_is_a_pipeline_name(registry):
    with pytest.raises(SpecError, match=r"stages\[0\]\.with\.pipeline"):
        load_pipeline_text(textwrap.dedent(CALLER).replace("inner@1", "../etc"), "outer.yaml", registry, CATALOG)
