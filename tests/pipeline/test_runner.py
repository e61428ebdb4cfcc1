"""Runner semantics: order, when, always, on_error, timeouts, cancellation, events."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from pipeline.context import Principal, RequestContext
from pipeline.events import Done, Error, StageFinished, StageStarted, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.runner import Pipeline, Runner
from tests import fakes


@pytest.fixture(autouse=True)
def clear_calls():
    fakes.CALLS.clear()


def build(yaml_text: str, registry, catalog=None) -> Pipeline:
    return Pipeline(load_pipeline_text(textwrap.dedent(yaml_text), "t.yaml", registry, catalog))


def request(text: str = "hello world", **kwargs) -> RequestContext:
    return RequestContext.from_text("t", text, **kwargs)


def shape(events) -> list[tuple]:
    out = []
    for event in events:
        if isinstance(event, StageStarted):
            out.append(("start", event.stage_id))
        elif isinstance(event, StageFinished):
            out.append(("finish", event.stage_id, event.status))
        elif isinstance(event, TextDelta):
            out.append(("text", event.text))
        else:
            out.append((type(event).__name__.lower(),))
    return out


async def collect(pipeline: Pipeline, ctx: RequestContext) -> list:
    return [event async for event in Runner().stream(pipeline, ctx)]


async def test_stages_run_in_order_and_events_follow(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: a, type: record}
          - {id: echo, type: echo, with: {chunks: 2}}
          - {id: c, type: record}
    """, registry)
    events = await collect(pipeline, request("abcd"))
    assert fakes.CALLS == ["a", "echo", "c"]
    assert shape(events) == [
        ("start", "a"), ("finish", "a", "ok"),
        ("start", "echo"), ("text", "ab"), ("text", "cd"), ("finish", "echo", "ok"),
        ("start", "c"), ("finish", "c", "ok"),
        ("done",),
    ]
    summary = events[-1].summary
    assert [s.id for s in summary.stages] == ["a", "echo", "c"]
    assert summary.output_text == "abcd"
    assert summary.ttft_s is not None and 0 < summary.ttft_s <= summary.duration_s
    assert len(summary.trace_id) == 32


async def test_when_skips_and_reads_context(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: admin, type: record, when: "role == 'admin'"}
          - {id: gold, type: record, when: "tags.tier in ['gold']"}
          - {id: always-true, type: record, when: "not (role == 'admin') or input == 'x'"}
    """, registry)
    ctx = request(principal=Principal("k1", "caller"), tags={"tier": "gold"})
    events = await collect(pipeline, ctx)
    assert fakes.CALLS == ["gold", "always-true"]
    assert ("finish", "admin", "skipped") in shape(events)
    assert ("start", "admin") not in shape(events)


async def test_failure_skips_the_rest_but_always_runs(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: a, type: record}
          - {id: bad, type: fail}
          - {id: c, type: record}
          - {id: audit, type: record, always: true}
    """, registry)
    ctx = request()
    events = await collect(pipeline, ctx)
    assert fakes.CALLS == ["a", "bad", "audit"]
    final = events[-1]
    assert isinstance(final, Error)
    assert (final.status, final.kind, final.stage_id) == ("failed", "stage_error", "bad")
    assert final.message == "ValueError: boom"
    assert [s.status for s in final.summary.stages] == ["ok", "failed", "skipped", "ok"]
    assert ctx.status == "failed"


async def test_on_error_skip_goes_on(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: bad, type: fail, on_error: skip}
          - {id: c, type: record}
    """, registry)
    events = await collect(pipeline, request())
    assert fakes.CALLS == ["bad", "c"]
    assert isinstance(events[-1], Done)
    assert [s.status for s in events[-1].summary.stages] == ["failed", "ok"]


async def test_policy_denial_runs_always_stages(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: guard, type: deny}
          - {id: c, type: record}
          - {id: audit, type: record, always: true}
    """, registry)
    ctx = request()
    events = await collect(pipeline, ctx)
    assert fakes.CALLS == ["guard", "audit"]
    final = events[-1]
    assert (final.status, final.kind, final.message) == ("denied", "policy_denied", "not allowed here")
    assert ctx.error.rule == "r1"


async def test_timeout_fails_the_stage(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: slow, type: record, timeout_s: 0.05, with: {delay_s: 5}}
          - {id: audit, type: record, always: true, timeout_s: 1}
    """, registry)
    events = await collect(pipeline, request())
    final = events[-1]
    assert (final.status, final.kind) == ("failed", "stage_timeout")
    assert final.message == "stage 'slow' timed out after 0.05 s"
    assert [s.status for s in final.summary.stages] == ["timeout", "ok"]


async def test_timeout_with_on_error_skip(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: slow, type: record, timeout_s: 0.01, on_error: skip, with: {delay_s: 5}}
          - {id: c, type: record}
    """, registry)
    events = await collect(pipeline, request())
    assert isinstance(events[-1], Done)
    assert fakes.CALLS == ["slow", "c"]


async def test_closing_the_stream_cancels_and_runs_always(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: echo, type: echo, with: {chunks: 4, delay_s: 0.05}}
          - {id: c, type: record}
          - {id: audit, type: record, always: true, with: {delay_s: 0.01}}
    """, registry)
    ctx = request("abcdefgh")
    stream = Runner().stream(pipeline, ctx)
    async for event in stream:
        if isinstance(event, TextDelta):
            break
    await stream.aclose()
    assert fakes.CALLS == ["echo", "audit"]
    assert ctx.status == "cancelled"
    assert [s.status for s in ctx.stages] == ["cancelled", "skipped", "ok"]


async def test_cancelling_the_consumer_task_runs_always(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: slow, type: record, with: {delay_s: 10}}
          - {id: audit, type: record, always: true, timeout_s: 1, with: {delay_s: 0.01}}
    """, registry)
    ctx = request()
    consumer = asyncio.create_task(collect(pipeline, ctx))
    await asyncio.sleep(0.05)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert fakes.CALLS == ["slow", "audit"]
    assert [s.status for s in ctx.stages] == ["cancelled", "ok"]


async def test_when_that_cannot_evaluate_fails_the_stage(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: a, type: record, when: "tags.size > 3"}
    """, registry)
    events = await collect(pipeline, request(tags={"size": "big"}))
    final = events[-1]
    assert (final.status, final.kind) == ("failed", "expression_error")
    assert fakes.CALLS == []


async def test_costs_add_up(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: a, type: record, with: {cost_usd: 0.25}}
          - {id: b, type: record, with: {cost_usd: 0.5, note: gpu}}
    """, registry)
    ctx = request()
    final = await Runner().run(pipeline, ctx)
    assert isinstance(final, Done)
    assert [s.cost_usd for s in final.summary.stages] == [0.25, 0.5]
    assert final.summary.cost_usd == 0.75
    assert [(e.stage_id, e.kind, e.detail) for e in ctx.ledger.entries] == [("a", "compute", ""),
                                                                            ("b", "compute", "gpu")]


async def test_concurrent_requests_are_isolated(registry):
    pipeline = build("""
        name: t
        stages:
          - {id: echo, type: echo, with: {chunks: 3, delay_s: 0.001}}
    """, registry)
    results = await asyncio.gather(*(Runner().run(pipeline, request(f"text {i}")) for i in range(20)))
    assert [r.summary.output_text for r in results] == [f"text {i}" for i in range(20)]
