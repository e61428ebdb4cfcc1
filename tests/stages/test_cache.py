"""The cache stage in a pipeline (prompt → tokenize → cache → generate → stream) over fake engines.

A hit relies on generate skipping the engine when ``token_stream`` is already set, and a store on
stream filling ``output_ids``.
"""

from __future__ import annotations

import logging
import textwrap

import numpy as np
import pytest

from pipeline.context import ChatMessage, Principal, RequestContext
from pipeline.events import Done, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from serving.backends.caches import StoreCaches
from stages.cache import CacheStage, ReplayStream
from store.response_cache import MemoryCache
from tests.fakes import FakeChatEngine, FakeEngine, FakeEngines

CATALOG = Catalog(models={"smol": ModelInfo("smol"), "big": ModelInfo("big")})

PIPELINE = """
name: cached
stages:
  - id: prompt
    type: prompt
  - id: tok
    type: tokenize
  - id: cache
    type: cache
    with: CACHE
  - id: gen
    type: generate
    with: {max_tokens: 50, temperature: 0}
  - id: out
    type: stream
"""


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def build(registry, cache_with: str = "{}", reply: str = "Paris is the capital. ¡Olé!", temperature: float = 0):
    registry.register(CacheStage)
    yaml_text = textwrap.dedent(PIPELINE).replace("CACHE", cache_with)
    yaml_text = yaml_text.replace("max_tokens: 50, temperature: 0}", f"max_tokens: 50, temperature: {temperature}}}")
    loaded = load_pipeline_text(yaml_text, "cached.yaml", registry, CATALOG)
    engines = FakeEngines(smol=FakeEngine(reply), big=FakeEngine("The big model says Paris."))
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=engines, caches=StoreCaches()))
    stage = next(b.stage for b in pipeline.stages if b.plan.spec.id == "cache")
    return pipeline, engines, stage


async def run(pipeline, text: str, **kwargs):
    messages = kwargs.pop("input_messages", None) or [ChatMessage("user", text)]
    ctx = RequestContext("cached", messages, **kwargs)
    events = [event async for event in Runner().stream(pipeline, ctx)]
    assert isinstance(events[-1], Done), events[-1]
    return ctx, "".join(e.text for e in events if isinstance(e, TextDelta))


def submitted(engines: FakeEngines) -> int:
    return sum(len(engine.submitted) for engine in engines.engines.values())


async def test_a_repeated_request_is_served_from_the_cache(registry):
    pipeline, engines, _ = build(registry)
    first, text = await run(pipeline, "What is the capital of France?")
    assert first.facts["cache"] == {"hit": False, "key": first.facts["cache"]["key"]}
    assert len(first.facts["cache"]["key"]) == 16 and submitted(engines) == 1
    second, again = await run(pipeline, "What is the capital of France?")
    assert submitted(engines) == 1  # the engine was not asked again
    assert again == text == "Paris is the capital. ¡Olé!"
    facts = second.facts["cache"]
    assert facts["hit"] is True and facts["kind"] == "exact" and facts["key"] == first.facts["cache"]["key"]
    assert facts["age_s"] >= 0
    assert second.finish_reason == first.finish_reason == "stop"
    assert second.output_ids == first.output_ids
    assert second.usage == first.usage and second.usage.input_tokens == len(second.prompt_ids)
    # A miss: the cache's storer and generate's close of its stream; a hit has nothing to store or close.
    assert len(first.finalizers) == 2 and not second.finalizers


async def test_a_cut_short_answer_is_replayed_with_its_finish_reason(registry):
    pipeline, engines, _ = build(registry)
    first, text = await run(pipeline, "Hi", params={"max_tokens": 5})
    second, again = await run(pipeline, "Hi", params={"max_tokens": 5})
    assert second.facts["cache"]["hit"] and submitted(engines) == 1
    assert again == text == "Paris" and second.finish_reason == first.finish_reason == "length"
    third, _ = await run(pipeline, "Hi")  # other params: another key
    assert not third.facts["cache"]["hit"] and submitted(engines) == 2


async def test_entries_expire_after_the_ttl(registry):
    pipeline, engines, stage = build(registry, "{ttl_s: 60}")
    stage.clock = clock = FakeClock()
    await run(pipeline, "Hello")
    clock.now += 30
    ctx, _ = await run(pipeline, "Hello")
    assert ctx.facts["cache"]["hit"] and ctx.facts["cache"]["age_s"] == 30
    clock.now += 30
    ctx, _ = await run(pipeline, "Hello")
    assert ctx.facts["cache"]["hit"] is False and submitted(engines) == 2


async def test_a_sampled_request_is_never_cached(registry):
    pipeline, engines, stage = build(registry)
    for _ in range(2):
        ctx, _ = await run(pipeline, "Tell me a story", params={"temperature": 0.7})
        assert ctx.facts["cache"] == {"hit": False, "skipped": "sampled"}
    assert submitted(engines) == 2 and len(stage.backend) == 0  # nothing stored either
    ctx, _ = await run(pipeline, "Tell me a story")  # the same prompt, greedy: not answered from a sample
    assert ctx.facts["cache"]["hit"] is False and submitted(engines) == 3


async def test_a_seeded_or_greedy_request_is_cached(registry):
    pipeline, engines, stage = build(registry, temperature=0.7)  # a sampling pipeline
    for _ in range(2):
        ctx, _ = await run(pipeline, "Tell me a story")
        assert ctx.facts["cache"]["hit"] is False  # looked up, never stored: generate sampled
    assert len(stage.backend) == 0 and submitted(engines) == 2
    for params in ({"temperature": 0.7, "seed": 7}, {"temperature": 0}):
        await run(pipeline, "Tell me a story", params=params)
        ctx, _ = await run(pipeline, "Tell me a story", params=params)
        assert ctx.facts["cache"]["hit"], params
    ctx, _ = await run(pipeline, "Tell me a story", params={"temperature": 0.0})  # 0 and 0.0: one key
    assert ctx.facts["cache"]["hit"] and submitted(engines) == 4


async def test_a_different_prompt_model_or_stop_is_a_miss(registry):
    pipeline, engines, _ = build(registry)
    await run(pipeline, "What is the capital of France?")
    variants = [{"text": "What is the capital of Spain?"}, {"model": "big"}, {"stop": ["."]},
                {"input_messages": [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"),
                                    ChatMessage("user", "What is the capital of France?")]}]
    for variant in variants:
        text = variant.pop("text", "What is the capital of France?")
        ctx, _ = await run(pipeline, text, **variant)
        assert ctx.facts["cache"]["hit"] is False, variant
    assert len(engines.engines["big"].submitted) == 1 and submitted(engines) == 5
    ctx, text = await run(pipeline, "What is the capital of France?", model="big")
    assert ctx.facts["cache"]["hit"] and text == "The big model says Paris."


async def test_a_chat_engine_is_never_cached(registry):
    pipeline, engines, stage = build(registry)
    engines.engines["smol"] = remote = FakeChatEngine("From afar.")
    for _ in range(2):
        ctx, text = await run(pipeline, "What is the capital of France?")
        assert ctx.facts["cache"] == {"hit": False, "skipped": "remote_backend"} and text == "From afar."
    assert len(remote.messages) == 2 and len(stage.backend) == 0


async def test_an_answer_over_max_entry_bytes_is_not_stored(registry):
    pipeline, engines, stage = build(registry, "{max_entry_bytes: 64}", reply="A long answer. " * 10)
    for _ in range(2):
        ctx, _ = await run(pipeline, "Hello")
        assert ctx.facts["cache"]["hit"] is False
    assert submitted(engines) == 2 and len(stage.backend) == 0


async def test_a_failing_backend_is_a_miss_and_the_request_succeeds(registry, monkeypatch, caplog):
    async def broken(self, *args):
        raise ConnectionError("cache down")

    monkeypatch.setattr(MemoryCache, "get", broken)
    monkeypatch.setattr(MemoryCache, "set", broken)
    pipeline, engines, _ = build(registry)
    with caplog.at_level(logging.WARNING, logger="stages.cache"):
        for _ in range(2):
            ctx, text = await run(pipeline, "My secret question")
            assert ctx.status == "ok" and text == "Paris is the capital. ¡Olé!"
            assert ctx.facts["cache"]["hit"] is False and ctx.facts["cache"]["error"] == "lookup: ConnectionError"
    assert submitted(engines) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("lookup failed" in m for m in messages) and any("store failed" in m for m in messages)
    assert not any("secret" in m for m in messages)  # never the prompt


async def test_an_unreachable_redis_is_a_miss_and_the_request_succeeds(registry):
    pipeline, engines, stage = build(registry, "{backend: redis, redis_url: 'redis://127.0.0.1:1/0'}")
    try:
        for _ in range(2):
            ctx, text = await run(pipeline, "Hello")
            assert ctx.status == "ok" and text and ctx.facts["cache"]["hit"] is False
        assert submitted(engines) == 2
    finally:
        await stage.aclose()


@pytest.mark.integration
async def test_the_redis_backend_serves_hits(registry, redis_url, redis_prefix):
    cache_with = f"{{backend: redis, redis_url: '{redis_url}', prefix: {redis_prefix}}}"
    pipeline, engines, stage = build(registry, cache_with)
    try:
        await run(pipeline, "Hello")
        ctx, text = await run(pipeline, "Hello")
        assert ctx.facts["cache"]["hit"] and text == "Paris is the capital. ¡Olé!" and submitted(engines) == 1
        assert len([key async for key in stage.backend.client.scan_iter(f"{redis_prefix}:*")]) == 1
    finally:
        await stage.aclose()


# --- semantic ----------------------------------------------------------------------


SEMANTIC = "{semantic: {enabled: true, threshold: 0.92}}"
HANDMADE = {"How do I reset my password?": [1.0, 0.0], "How can I reset my password?": [0.96, 0.28],
            "How do I delete my account?": [0.8, 0.6]}  # cosines with the first: 0.96 and 0.8


async def test_a_similar_question_is_a_semantic_hit_and_a_less_similar_one_is_not(registry, monkeypatch):
    monkeypatch.setattr(StoreCaches, "embed", lambda self, text: np.array(HANDMADE[text], dtype=np.float32))
    pipeline, engines, _ = build(registry, SEMANTIC)
    await run(pipeline, "How do I reset my password?")
    ctx, text = await run(pipeline, "How can I reset my password?")
    assert ctx.facts["cache"]["hit"] and ctx.facts["cache"]["kind"] == "semantic"
    assert ctx.facts["cache"]["similarity"] == pytest.approx(0.96, abs=1e-3)
    assert text == "Paris is the capital. ¡Olé!" and submitted(engines) == 1
    ctx, _ = await run(pipeline, "How do I delete my account?")
    assert ctx.facts["cache"]["hit"] is False and submitted(engines) == 2
    # Per tenant, and per conversation: the same question elsewhere is a miss.
    ctx, _ = await run(pipeline, "How can I reset my password?", principal=Principal("k", "caller", "acme"))
    assert ctx.facts["cache"]["hit"] is False
    history = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"),
               ChatMessage("user", "How can I reset my password?")]
    ctx, _ = await run(pipeline, "", input_messages=history)
    assert ctx.facts["cache"]["hit"] is False and submitted(engines) == 4


async def test_a_failing_embedder_is_a_miss(registry, monkeypatch):
    def broken(text):
        raise RuntimeError("no model")

    monkeypatch.setattr(StoreCaches, "embed", lambda self, text: broken(text))
    pipeline, engines, _ = build(registry, SEMANTIC)
    ctx, text = await run(pipeline, "Hello")
    assert ctx.status == "ok" and text and ctx.facts["cache"]["error"] == "embedding: RuntimeError"
    ctx, _ = await run(pipeline, "Hello")  # the exact entry was still stored
    assert ctx.facts["cache"]["kind"] == "exact" and submitted(engines) == 1


@pytest.mark.slow
async def test_a_paraphrase_is_a_semantic_hit_with_the_real_embedder(registry):
    pipeline, engines, _ = build(registry, SEMANTIC)
    await run(pipeline, "What is the capital of France?")
    ctx, _ = await run(pipeline, "What's France's capital?")
    assert ctx.facts["cache"]["kind"] == "semantic" and ctx.facts["cache"]["similarity"] >= 0.92
    for other in ("What is the capital of Germany?", "How do I bake sourdough bread?"):
        ctx, _ = await run(pipeline, other)
        assert ctx.facts["cache"]["hit"] is False, other
    assert submitted(engines) == 3


# --- the replay stream ---------------------------------------------------------------


async def test_the_replay_stream_looks_like_an_engine_stream():
    events = [e async for e in ReplayStream([7, 8, 9], "length", num_prompt_tokens=12)]
    assert [e.token_id for e in events] == [7, 8, 9]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert [e.num_output_tokens for e in events] == [1, 2, 3]
    assert {(e.num_prompt_tokens, e.num_cached_tokens) for e in events} == {(12, 12)}
    empty = [e async for e in ReplayStream([], "stop", num_prompt_tokens=3)]
    assert [(e.token_id, e.finish_reason, e.num_output_tokens) for e in empty] == [(None, "stop", 0)]
