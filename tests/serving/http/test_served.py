"""The executor's bookkeeping: in-flight count and metrics, however a stream ends."""

from __future__ import annotations

import json
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from pipeline.context import ChatMessage, RequestContext, Usage
from pipeline.events import Done, Summary, TextDelta
from serving.http.metrics import HttpMetrics
from serving.http.served import Executor, sse_event


class OneAnswer:
    """A runner that streams one delta and then its Done."""

    async def stream(self, pipeline, ctx):
        yield TextDelta("hi", "gen")
        yield Done(Summary(ctx.request_id, "0" * 32, "chat", 0.01, 0.005, 0.0, (), Usage(1, 1), "hi", "stop"))


def requests(registry: CollectorRegistry, status: str) -> float:
    return registry.get_sample_value("inferline_pipeline_requests_total", {"pipeline": "chat", "status": status}) or 0.0


async def test_a_request_is_counted_before_its_final_event_goes_out():
    registry = CollectorRegistry()
    executor = Executor({"chat": SimpleNamespace(name="chat")}, OneAnswer(), HttpMetrics(registry))
    stream = executor.stream(executor.pipelines["chat"], RequestContext("chat", [ChatMessage("user", "hello")]))
    seen = []
    async for event in stream:
        seen.append(event)
        if isinstance(event, Done):
            # What a client holding the answer would find at /metrics now, before the stream closes.
            assert requests(registry, "ok") == 1.0
    assert [type(e) for e in seen] == [TextDelta, Done]
    assert requests(registry, "ok") == 1.0 and executor.in_flight == 0


async def test_a_client_that_leaves_is_counted_as_disconnected():
    registry = CollectorRegistry()
    executor = Executor({"chat": SimpleNamespace(name="chat")}, OneAnswer(), HttpMetrics(registry))
    stream = executor.stream(executor.pipelines["chat"], RequestContext("chat", [ChatMessage("user", "hello")]))
    assert isinstance(await anext(stream), TextDelta)
    await stream.aclose()
    assert requests(registry, "disconnected") == 1.0 and requests(registry, "ok") == 0.0
    assert executor.in_flight == 0


def test_an_events_data_is_one_line_of_json_whatever_the_text():
    text = "line one\nline two\r\nthird\u2028, naïve 東京 🙂, a \"quote\", a tab\t, a nul \x00"
    raw = sse_event("delta", {"text": text, "n": [1, 2.5, None, True]})
    head, data, end = raw.split(b"\r\n", 2)
    assert head == b"event: delta" and data.startswith(b"data: ") and end == b"\r\n"
    assert b"\n" not in data and b"\r" not in data
    assert json.loads(data[len(b"data: "):]) == {"text": text, "n": [1, 2.5, None, True]}
