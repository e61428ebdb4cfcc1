"""The console's trace ring, the runner that fills it, and the waterfall it draws."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from pipeline.context import Principal, RequestContext, StageRecord
from pipeline.loader import load_pipeline_text
from pipeline.runner import Pipeline, Runner
from serving.console.trace_ring import RecordingRunner, TraceEntry, TraceRing
from serving.console.trace_view import attributes, from_entry, from_record


def entry(n: int, key_id: str | None = None) -> TraceEntry:
    stages = (StageRecord("guard", "policy", "ok", 0.0, 0.002, 0.0),
              StageRecord("gen", "generate", "ok", 0.002, 0.006, 0.001),
              StageRecord("out", "stream", "ok", 0.008, 0.010, 0.002))
    return TraceEntry(request_id=f"req{n}", trace_id=f"{n:032x}", pipeline="chat",
                      received_at=datetime(2026, 11, 1, tzinfo=UTC), status="ok", duration_ms=20.0, ttft_ms=10.0,
                      cost_usd=0.003, input_tokens=5, output_tokens=7, prompt_tokens=5, model="smol",
                      finish_reason="stop", key_id=key_id, role="caller", stages=stages,
                      facts={"sampling": {"temperature": 0, "max_tokens": 64}},
                      decisions={"guard": {"action": "allow"}})


def test_ring_keeps_the_newest_and_finds_by_either_id():
    ring = TraceRing(capacity=3)
    for n in range(5):
        ring.add(entry(n, key_id="a" if n % 2 else "b"))
    assert len(ring) == 3
    assert ring.get(f"{0:032x}") is None and ring.get("req1") is None  # evicted, both indexes
    assert ring.get("req4").trace_id == f"{4:032x}" and ring.get(f"{3:032x}").request_id == "req3"
    assert [e.request_id for e in ring.recent()] == ["req4", "req3", "req2"]
    assert [e.request_id for e in ring.recent(key_id="a", everyone=False)] == ["req3"]
    assert ring.recent(key_id=None, everyone=False) == []


def test_waterfall_geometry_and_ttft():
    view = from_entry(entry(1))
    assert view.span_ms == 20.0 and view.ttft_pct == 50.0
    assert [(r.x_pct, r.width_pct) for r in view.rows] == [(0.0, 10.0), (10.0, 30.0), (40.0, 50.0)]
    gen = dict(view.rows[1].attributes)
    assert gen == {"model": "smol", "input tokens": "5", "temperature": "0", "max_tokens": "64"}
    assert dict(view.rows[2].attributes) == {"output tokens": "7", "finish reason": "stop"}
    assert dict(view.rows[0].attributes) == {"action": "allow"}


def test_audit_record_starts_are_cumulative_durations():
    record = {"id": "r1", "request_id": "req", "trace_id": "t" * 32, "pipeline": "rag", "status": "denied",
              "duration_ms": 12.0, "ttft_ms": None, "cost_usd": 0.0, "input_tokens": 0, "output_tokens": 0,
              "received_at": "2026-11-01T00:00:00+00:00",
              "retrieval": {"index": "handbook", "version": 3, "ids": ["a#0", "b#1"], "scores": [0.8, 0.5]},
              "policy": [{"stage": "guard", "rule": "injection.x", "category": "injection", "action": "block"}],
              "stages": [{"stage_id": "context", "type": "retrieve", "status": "ok", "duration_ms": 4.0,
                          "cost_usd": 0.0, "decision": {"documents": 2}},
                         {"stage_id": "guard", "type": "policy", "status": "denied", "duration_ms": 3.0,
                          "cost_usd": 0.0, "decision": {"action": "block", "rules": ["injection.x"]}},
                         {"stage_id": "gen", "type": "generate", "status": "skipped", "duration_ms": 0.0,
                          "cost_usd": 0.0, "decision": None}]}
    view = from_record(record)
    assert view.source == "audit" and view.record_id == "r1" and view.notes
    assert [(r.start_ms, r.duration_ms) for r in view.rows] == [(0.0, 4.0), (4.0, 3.0), (7.0, 0.0)]
    assert view.rows[2].width_pct == 0.0 and view.rows[2].attributes == ()  # skipped: a tick, no attributes
    assert dict(view.rows[0].attributes) == {"index": "handbook v3", "documents": "2", "top score": "0.800"}
    assert dict(view.rows[1].attributes)["rules"] == '["injection.x"]'
    assert view.ttft_pct is None and view.policy[0]["action"] == "block"


def test_attributes_of_route_and_cache():
    facts = {"route": {"model": "big", "reason": "rules[0]", "mode": "rules"}, "cache": {"hit": True}}
    assert dict(attributes("route", None, facts)) == {"model": "big", "reason": "rules[0]"}
    assert dict(attributes("cache", None, facts)) == {"cache": "hit"}


async def test_recording_runner_keeps_every_stage_and_no_content(registry, catalog):
    loaded = load_pipeline_text("name: p\nstages:\n  - {id: a, type: record}\n  - {id: e, type: echo}\n", "p.yaml",
                                registry, catalog)
    ring = TraceRing()
    runner = RecordingRunner(Runner(), ring)
    ctx = RequestContext.from_text("p", "secret words", principal=Principal("k1", "caller"))
    events = [event async for event in runner.stream(Pipeline(loaded), ctx)]
    assert type(events[-1]).__name__ == "Done"
    kept = ring.get(ctx.request_id)
    assert kept is not None and [s.id for s in kept.stages] == ["a", "e"] and kept.key_id == "k1"
    assert kept.ttft_ms is not None and kept.stages[1].started_s >= kept.stages[0].started_s
    assert "secret" not in repr(kept)


async def test_recording_runner_keeps_a_disconnected_request(registry, catalog):
    loaded = load_pipeline_text("name: p\nstages:\n  - {id: e, type: echo, with: {chunks: 4, delay_s: 0.05}}\n",
                                "p.yaml", registry, catalog)
    ring = TraceRing()
    ctx = RequestContext.from_text("p", "abcdefgh")
    stream = RecordingRunner(Runner(), ring).stream(Pipeline(loaded), ctx)
    async for event in stream:
        if type(event).__name__ == "TextDelta":
            break
    await stream.aclose()  # the client went away mid-answer
    await asyncio.sleep(0)
    kept = ring.get(ctx.request_id)
    assert kept is not None and kept.status == "disconnected"


def test_audit_record_steps_start_where_the_record_says():
    """A workflow's record keeps each step's start: steps that ran side by side overlap in the waterfall, and a
    loop's rounds and a sub-pipeline's steps are named as such."""
    def stage(stage_id, duration_ms, **step):
        return {"stage_id": stage_id, "type": "llm", "status": "ok", "duration_ms": duration_ms, "cost_usd": 0.0,
                "decision": None, "step": {"attempt": 1, **step}}

    record = {"duration_ms": 10.0, "stages": [stage("a", 6.0, started_ms=0.0), stage("b", 5.0, started_ms=1.0),
                                              stage("a", 2.0, started_ms=6.0, round=2, attempt=2),
                                              stage("x", 1.0, started_ms=8.0, parent="call")]}
    view = from_record(record)
    assert [(r.start_ms, r.duration_ms) for r in view.rows] == [(0.0, 6.0), (1.0, 5.0), (6.0, 2.0), (8.0, 1.0)]
    assert [r.label for r in view.rows] == ["a", "b", "a@2", "call / x"] and view.rows[2].stage.attempt == 2
    assert not any("sum of the durations" in note for note in view.notes)
