"""The route stage and generate's fallbacks, over fake engines
(a real remote: tests/serving/backends/test_remote.py)."""

from __future__ import annotations

import asyncio
import textwrap
from collections import Counter

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import tracing
from pipeline.context import ChatMessage, Principal, RequestContext
from pipeline.errors import BackendError, Overloaded, SpecError
from pipeline.events import Done, Error, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, ModelOccupancy, Resources
from pipeline.runner import Pipeline, Runner
from tests.fakes import FakeChatEngine, FakeEngine, FakeEngines

CATALOG = Catalog(models={"smol": ModelInfo("smol", context_window=64), "big": ModelInfo("big", context_window=4096),
                          "canary": ModelInfo("canary"), "remote": ModelInfo("remote")})


class FailingEngine(FakeEngine):
    def __init__(self, error: Exception):
        super().__init__("never")
        self.error, self.calls = error, 0

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        self.calls += 1
        raise self.error


class SilentEngine(FakeEngine):
    """Accepts the request, then never sends a token."""

    def __init__(self):
        super().__init__("never")
        self.closed = 0

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        engine = self

        class Stream:
            def __aiter__(self):
                return self._events()

            async def _events(self):
                await asyncio.sleep(3600)
                yield None

            async def aclose(self):
                engine.closed += 1

        return Stream()


def build(registry, route: str, **engines):
    yaml_text = f"""
    name: routed
    stages:
      - {{id: prompt, type: prompt}}
      - {{id: pick, type: route, with: {route}}}
      - {{id: tok, type: tokenize}}
      - {{id: gen, type: generate, with: {{max_tokens: 32, temperature: 0}}}}
      - {{id: out, type: stream}}
    """
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "routed.yaml", registry, CATALOG)
    provider = FakeEngines(**({"smol": FakeEngine("small"), "big": FakeEngine("BIG")} | engines))
    resources = Resources(CATALOG, engines=provider)
    return Pipeline(loaded, resources), provider, resources


async def run(pipeline, text="hi", **kwargs):
    ctx = RequestContext.from_text("routed", text, **kwargs)
    events = [e async for e in Runner().stream(pipeline, ctx)]
    return ctx, events, "".join(e.text for e in events if isinstance(e, TextDelta))


async def test_rules_first_match_with_reasons(registry):
    route = """{rules: [{when: "prompt_tokens > 40", model: big, reason: long prompt},
                        {when: "tags.tier == 'gold'", model: big}], default: smol, context_check: false}"""
    pipeline, _, _ = build(registry, route)
    ctx, _, text = await run(pipeline, "hi")
    assert (ctx.model, text, ctx.facts["route"]["mode"], ctx.facts["route"]["reason"]) == (
        "smol", "small", "default", "no rule matched")
    ctx, _, text = await run(pipeline, "x" * 60)
    assert (ctx.model, ctx.facts["route"]["reason"]) == ("big", "long prompt")
    ctx, _, _ = await run(pipeline, "hi", tags={"tier": "gold"})
    assert ctx.facts["route"]["reason"] == "rules[1]: tags.tier == 'gold'"
    assert ctx.facts["decisions"]["pick"]["model"] == "big"


async def test_weighted_split_is_sticky_per_caller_and_follows_the_weights(registry):
    pipeline, _, _ = build(registry, "{split: [{model: smol, weight: 80}, {model: big, weight: 20}], sticky: true, "
                                     "context_check: false}")
    arms = Counter()
    for caller in range(200):
        ctx, _, _ = await run(pipeline, principal=Principal(f"key{caller}", "caller"))
        arms[ctx.model] += 1
        again, _, _ = await run(pipeline, principal=Principal(f"key{caller}", "caller"))
        assert again.model == ctx.model  # sticky
    assert 120 < arms["smol"] < 190 and arms["big"] > 10
    assert ctx.facts["route"]["reason"].endswith("arm (sticky)")


async def test_balance_picks_the_least_busy(registry):
    pipeline, provider, _ = build(registry, "{balance: [smol, big], context_check: false}")
    provider.loads = {"smol": ModelOccupancy(waiting=5, running=8, ttft_s=0.05),
                      "big": ModelOccupancy(1, 8, ttft_s=0.5)}
    ctx, _, _ = await run(pipeline)
    assert ctx.model == "big" and ctx.facts["route"]["reason"] == "fewest waiting (1 waiting, 8 running)"
    pipeline, provider, _ = build(registry, "{balance: [smol, big], balance_by: ttft, context_check: false}")
    provider.loads = {"smol": ModelOccupancy(5, 8, ttft_s=0.05), "big": ModelOccupancy(1, 8, ttft_s=0.5)}
    ctx, _, _ = await run(pipeline)
    assert ctx.model == "smol" and "lowest recent ttft" in ctx.facts["route"]["reason"]


@pytest.mark.parametrize("error", [Overloaded("full", retry_after_s=2), BackendError("down")])
async def test_fallback_on_failure_with_retries_and_cooldown(registry, error):
    failing = FailingEngine(error)
    pipeline, _, resources = build(registry, "{default: smol, fallback: [big], retries: 1, cooldown_s: 0.2, "
                                             "context_check: false}", smol=failing)
    ctx, events, text = await run(pipeline)
    assert isinstance(events[-1], Done) and text == "BIG" and ctx.model == "big"
    assert failing.calls == 2  # one retry on the same model first
    assert ctx.facts["route"]["fallbacks_tried"] == [{"model": "smol", "attempt": 1, "error": error.kind},
                                                     {"model": "smol", "attempt": 2, "error": error.kind}]
    ctx, _, _ = await run(pipeline)  # smol rests: not even tried
    assert failing.calls == 2 and ctx.facts["route"]["fallbacks_tried"] == [{"model": "smol", "error": "cooldown"}]
    await asyncio.sleep(0.25)  # the cooldown expires: smol is tried again
    await run(pipeline)
    assert failing.calls == 4 and "smol" in resources.cooldowns


async def test_a_silent_model_times_out_and_falls_back(registry):
    silent = SilentEngine()
    pipeline, _, _ = build(registry, "{default: smol, fallback: [big], first_token_timeout_s: 0.1, "
                                     "context_check: false}", smol=silent)
    ctx, _, text = await run(pipeline)
    assert text == "BIG" and silent.closed == 1
    assert ctx.facts["route"]["fallbacks_tried"][0]["error"] == "backend_error"


async def test_when_every_model_fails_the_request_fails_with_the_first_models_error(registry):
    pipeline, _, _ = build(registry, "{default: smol, fallback: [big], context_check: false}",
                           smol=FailingEngine(BackendError("down")), big=FailingEngine(Overloaded("full")))
    ctx, events, _ = await run(pipeline)
    assert isinstance(events[-1], Error) and events[-1].kind == "backend_error"
    assert [t["model"] for t in ctx.facts["route"]["fallbacks_tried"]] == ["smol", "big"]


async def test_a_fallback_to_a_remote_backend_gets_the_chat_messages(registry):
    remote = FakeChatEngine()
    pipeline, _, _ = build(registry, "{default: smol, fallback: [remote], context_check: false}",
                           smol=FailingEngine(BackendError("down")), remote=remote)
    ctx, _, text = await run(pipeline, "Bonjour")
    assert text == "From afar." and ctx.model == "remote"
    assert remote.messages == [[{"role": "user", "content": "Bonjour"}]]


async def test_the_context_window_check_reroutes_or_refuses(registry):
    pipeline, _, _ = build(registry, "{default: smol, fallback: [big], reserve_output_tokens: 16}")
    ctx, _, _ = await run(pipeline, "x" * 100)  # ~106 byte-tokens: over smol's 64
    assert ctx.model == "big" and ctx.facts["route"]["mode"] == "context"
    pipeline, _, _ = build(registry, "{default: smol, reserve_output_tokens: 16}")
    ctx, events, _ = await run(pipeline, "x" * 100)
    assert events[-1].kind == "invalid_input" and "context window" in events[-1].message


@pytest.mark.parametrize(("route", "message"), [
    ("{rules: [{when: 'prompt_tokens >', model: big}]}", "bad expression"),
    ("{rules: [{when: 'nope > 1', model: big}]}", "unknown field 'nope'"),
    ("{default: bgi}", "unknown model 'bgi'; did you mean 'big'?"),
    ("{split: [{model: smol, weight: 0}]}", "greater than 0"),
])
def test_configuration_errors_are_located(registry, route, message):
    with pytest.raises(SpecError) as caught:
        build(registry, route)
    assert str(caught.value).startswith("routed.yaml:5:") and message in str(caught.value)


class ErrorsBeforeText(FakeEngine):
    """Accepts the request, then fails before its first token (an engine error, a remote error chunk)."""

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        class Stream:
            def __aiter__(self):
                return self._events()

            async def _events(self):
                raise BackendError("failed while prefilling")
                yield

            async def aclose(self):
                return None

        return Stream()


async def test_an_error_before_the_first_token_falls_back_without_a_deadline(registry):
    pipeline, _, _ = build(registry, "{default: smol, fallback: [big], context_check: false}",
                           smol=ErrorsBeforeText("x"))
    _, events, text = await run(pipeline)
    assert isinstance(events[-1], Done) and text == "BIG"


async def test_a_rule_over_a_tag_of_the_wrong_type_does_not_match(registry):
    pipeline, _, _ = build(registry, "{rules: [{when: 'tags.priority > 5', model: big}], default: smol, "
                                     "context_check: false}")
    ctx, events, _ = await run(pipeline, tags={"priority": "high"})
    assert isinstance(events[-1], Done) and ctx.model == "smol"
    assert ctx.facts["route_rule_errors"][0].startswith("rules[0]:")


async def test_a_remote_fallback_gets_the_conversation_as_tokenize_trimmed_it(registry):
    remote = FakeChatEngine()
    yaml_text = """
    name: routed
    stages:
      - {id: prompt, type: prompt}
      - {id: pick, type: route, with: {default: smol, fallback: [remote], context_check: false}}
      - {id: tok, type: tokenize, with: {max_input_tokens: 40, overflow: drop_oldest}}
      - {id: gen, type: generate, with: {max_tokens: 8}}
      - {id: out, type: stream}
    """
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "routed.yaml", registry, CATALOG)
    engines = FakeEngines(smol=FailingEngine(BackendError("down")), remote=remote)
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=engines))
    turns = [ChatMessage("user", "a" * 30), ChatMessage("assistant", "b" * 30), ChatMessage("user", "last?")]
    ctx = RequestContext("routed", turns)
    final = await Runner().run(pipeline, ctx)
    assert isinstance(final, Done)
    assert remote.messages == [[{"role": "user", "content": "last?"}]]


async def test_the_decision_and_the_fallbacks_are_in_the_trace(registry):
    exporter = InMemorySpanExporter()
    provider = tracing.make_tracer_provider("none")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pipeline, _, _ = build(registry, "{rules: [{when: \"tags.tier == 'gold'\", model: smol, reason: gold}], "
                                     "fallback: [big], context_check: false}", smol=FailingEngine(BackendError("x")))
    ctx = RequestContext.from_text("routed", "hi", tags={"tier": "gold"})
    await Runner(provider.get_tracer("test")).run(pipeline, ctx)
    provider.shutdown()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    pick = spans["stage pick"].attributes
    assert (pick["inferline.route.model"], pick["inferline.route.mode"], pick["inferline.route.reason"]) == (
        "smol", "rule", "gold")
    gen = spans["stage gen"].attributes
    assert gen["gen_ai.request.model"] == "smol" and gen["gen_ai.response.model"] == "big"  # smol failed over
    assert gen["gen_ai.provider.name"] == "inferline" and gen["inferline.route.fallbacks_tried"] == 1


@pytest.mark.parametrize("late", [
    "{id: pick, type: route, with: {default: smol}}", "{id: guard, type: policy}", "{id: c, type: cache}"])
def test_deciding_stages_after_generate_are_load_errors(registry, late):
    yaml_text = f"""
    name: late
    stages:
      - {{id: prompt, type: prompt}}
      - {{id: tok, type: tokenize}}
      - {{id: gen, type: generate}}
      - {late}
      - {{id: out, type: stream}}
    """
    with pytest.raises(SpecError, match=r"late.yaml:7:.*must come before stage 'gen' \(generate\)"):
        load_pipeline_text(textwrap.dedent(yaml_text), "late.yaml", registry, CATALOG)
