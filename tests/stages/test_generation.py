"""tokenize, generate and stream against a fake engine (the real one is in tests/serving)."""

from __future__ import annotations

import textwrap

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import tracing
from pipeline.context import ChatMessage, Principal, RequestContext
from pipeline.cost import Price
from pipeline.events import Done, Error, StageStarted, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from tests.fakes import FakeChatEngine, FakeEngine, FakeEngines

CATALOG = Catalog(models={"smol": ModelInfo("smol", Price(input_per_1k=1.0, output_per_1k=2.0)),
                          "big": ModelInfo("big")})

CHAT = """
name: chat
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize, with: {max_input_tokens: 60, overflow: drop_oldest}}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0, isolate_tenants: true}}
  - {id: out, type: stream, with: {stop: ["¡Olé"]}}
"""


def build(yaml_text: str, registry, engines) -> Pipeline:
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "p.yaml", registry, CATALOG)
    return Pipeline(loaded, Resources(CATALOG, engines=engines))


async def run(pipeline, ctx):
    return [event async for event in Runner().stream(pipeline, ctx)]


async def test_chat_streams_text_until_the_stop_string(registry):
    engines = FakeEngines()
    ctx = RequestContext.from_text("chat", "Capital of France?", principal=Principal("k", "caller", "acme"))
    events = await run(build(CHAT, registry, engines), ctx)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == "Paris is the capital. "
    assert isinstance(events[-1], Done)
    assert ctx.finish_reason == "stop" and ctx.output_text == text
    engine = engines.engines["smol"]
    prompt_ids, sampling, salt = engine.submitted[0]
    assert bytes(prompt_ids) == b"<user>Capital of France?"
    assert (sampling.max_tokens, sampling.temperature, salt) == (64, 0.0, "acme")
    assert engine.streams[0].closed  # left early at the stop string: the engine request is aborted
    assert ctx.usage.input_tokens == len(prompt_ids)
    stream_cost = events[-1].summary.stages[-1].cost_usd
    assert stream_cost == pytest.approx((ctx.usage.input_tokens * 1.0 + ctx.usage.output_tokens * 2.0) / 1000)


async def test_max_tokens_finishes_with_length(registry):
    pipeline = build(CHAT.replace("max_tokens: 64", "max_tokens: 5"), registry, FakeEngines())
    ctx = RequestContext.from_text("chat", "hi")
    await run(pipeline, ctx)
    assert (ctx.output_text, ctx.finish_reason, ctx.usage.output_tokens) == ("Paris", "length", 5)


async def test_multibyte_text_is_never_split(registry):
    engines = FakeEngines(smol=FakeEngine("añb👋c"))
    events = await run(build(CHAT, registry, engines), RequestContext.from_text("chat", "x"))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert "".join(deltas) == "añb👋c"
    assert not any("\ufffd" in d for d in deltas)


async def test_client_params_are_allow_listed_and_capped(registry):
    pipeline = build(CHAT, registry, FakeEngines())
    ok = RequestContext.from_text("chat", "x", params={"max_tokens": 8, "temperature": 0.5})
    await run(pipeline, ok)
    assert ok.usage.output_tokens == 8
    for params, message in [({"max_tokens": 65}, "over this pipeline's limit of 64"),
                            ({"speculative": False}, "does not let callers set ['speculative']"),
                            ({"temperature": -1}, "invalid sampling parameters: temperature")]:
        events = await run(pipeline, RequestContext.from_text("chat", "x", params=params))
        final = events[-1]
        assert isinstance(final, Error) and final.kind == "invalid_input" and message in final.message


async def test_overlong_input_drops_oldest_turns_or_fails(registry):
    engines = FakeEngines()
    history = [ChatMessage("user", "old question " * 3), ChatMessage("assistant", "old answer " * 3),
               ChatMessage("user", "new?")]
    ctx = RequestContext("chat", history)
    await run(build(CHAT, registry, engines), ctx)
    assert bytes(engines.engines["smol"].submitted[0][0]) == b"<user>new?"
    strict = build(CHAT.replace("overflow: drop_oldest", "overflow: error"), registry, FakeEngines())
    events = await run(strict, RequestContext("chat", history))
    assert events[-1].kind == "invalid_input"
    assert "over this pipeline's limit of 60" in events[-1].message


async def test_routed_model_is_used(registry):
    engines = FakeEngines(smol=FakeEngine("small"), big=FakeEngine("BIG"))
    pipeline = build("""
        name: chat
        stages:
          - {id: pick, type: pick, with: {default: big}}
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - {id: gen, type: generate}
          - {id: out, type: stream}
    """, registry, engines)
    ctx = RequestContext.from_text("chat", "x")
    await run(pipeline, ctx)
    assert (ctx.model, ctx.output_text) == ("big", "BIG")


async def test_cancelling_mid_stream_aborts_the_engine_request(registry):
    engines = FakeEngines(smol=FakeEngine("a long answer " * 20))
    stream = Runner().stream(build(CHAT, registry, engines), RequestContext.from_text("chat", "x"))
    async for event in stream:
        if isinstance(event, TextDelta):
            break
    await stream.aclose()
    assert engines.engines["smol"].streams[0].closed


def test_generation_stages_need_their_inputs(registry):
    from pipeline.errors import SpecError

    with pytest.raises(SpecError, match=r"reads 'prompt_ids'.*add a stage of type tokenize"):
        load_pipeline_text("name: x\nstages: [{id: g, type: generate}]\n", "x.yaml", registry, CATALOG)
    with pytest.raises(SpecError, match="no model to tokenize for"):
        load_pipeline_text("name: x\nstages: [{id: p, type: prompt}, {id: t, type: tokenize}]\n", "x.yaml",
                           registry, Catalog())


async def test_a_stream_no_stage_read_is_closed_when_the_request_fails(registry):
    engines = FakeEngines()
    pipeline = build(CHAT.replace("  - {id: out,", "  - {id: boom, type: fail}\n  - {id: out,"), registry, engines)
    ctx = RequestContext.from_text("chat", "x")
    events = await run(pipeline, ctx)
    assert isinstance(events[-1], Error) and [s.status for s in ctx.stages][-2:] == ["failed", "skipped"]
    stream = engines.engines["smol"].streams[0]
    assert stream.sent == 1 and stream.closed  # read up to its first token only; its opener, generate, closed it


async def test_a_stream_no_stage_read_is_closed_when_the_request_is_cancelled(registry):
    engines = FakeEngines()
    pipeline = build(CHAT.replace("  - {id: out,", "  - {id: wait, type: record, with: {delay_s: 10}}\n  - {id: out,"),
                     registry, engines)
    stream = Runner().stream(pipeline, RequestContext.from_text("chat", "x"))
    async for event in stream:
        if isinstance(event, StageStarted) and event.stage_id == "wait":
            break
    assert not engines.engines["smol"].streams[0].closed
    await stream.aclose()  # the client went away before the stream stage ran
    assert engines.engines["smol"].streams[0].closed


@pytest.mark.parametrize(("kind", "provider"), [(FakeChatEngine, "openai"), (FakeEngine, "inferline")])
async def test_a_chat_engine_gets_the_messages_and_is_traced_as_openai(registry, kind, provider):
    engine = kind("Bonjour.")
    exporter = InMemorySpanExporter()
    tracer_provider = tracing.make_tracer_provider("none")
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    pipeline = build(CHAT, registry, FakeEngines(smol=engine))
    ctx = RequestContext.from_text("chat", "Salut")
    final = await Runner(tracer_provider.get_tracer("test")).run(pipeline, ctx)
    tracer_provider.shutdown()
    assert isinstance(final, Done) and ctx.output_text == "Bonjour."
    gen = next(span for span in exporter.get_finished_spans() if span.name == "stage gen").attributes
    assert gen["gen_ai.provider.name"] == provider
    if provider == "openai":  # its own chat template: the messages, never token ids
        assert engine.messages == [[{"role": "user", "content": "Salut"}]]
