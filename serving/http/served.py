"""Runs requests for the HTTP layer: finds the pipeline, counts in-flight work, records metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from litestar.response import Stream

from pipeline.context import RequestContext
from pipeline.events import Done, Error, Event, StageFinished, TextDelta, final_event
from pipeline.runner import Pipeline, Runner
from serving.http.metrics import HttpMetrics
from serving.http.problems import Problem
from serving.runtime.shadow import Shadows


class Executor:
    """Every served pipeline, the runner, and the count of requests in flight."""

    def __init__(self, pipelines: dict[str, Pipeline], runner: Runner, metrics: HttpMetrics,
                 shadows: Shadows | None = None):
        self.pipelines = pipelines
        self.runner = runner
        self.metrics = metrics
        #: Mirrors a share of the answered requests onto a candidate version (shadow traffic).
        self.shadows = shadows
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def get(self, name: str) -> Pipeline:
        pipeline = self.pipelines.get(name)
        if pipeline is None:
            raise Problem(404, "Not found", f"no pipeline {name!r}; served: {', '.join(sorted(self.pipelines))}",
                          "pipeline_not_found")
        return pipeline

    async def stream(self, pipeline: Pipeline, ctx: RequestContext) -> AsyncIterator[Event]:
        """The runner's events; metrics are recorded however the stream ends, and before the final
        event goes out: a client that reads /metrics once it has its answer finds the answer counted."""
        self._enter()
        final: Done | Error | None = None
        try:
            async for event in self.runner.stream(pipeline, ctx):
                if isinstance(event, (Done, Error)) and final is None:
                    final = event
                    self._observe(pipeline, ctx, event)
                yield event
        finally:
            self._leave()
            if final is None:
                self._observe(pipeline, ctx, None)
            elif self.shadows is not None:  # once the answer is out: a shadow never holds it up
                self.shadows.mirror(pipeline, ctx, final)

    def _observe(self, pipeline: Pipeline, ctx: RequestContext, final: Done | Error | None) -> None:
        self.metrics.observe_cache(pipeline.name, ctx.facts.get("cache"))
        self.metrics.observe_online_eval(pipeline.name, ctx.facts.get("online_eval"))
        if final is not None:
            self.metrics.observe(final.summary, "ok" if isinstance(final, Done) else final.status)
        else:
            self.metrics.observe_disconnected(pipeline.name)

    async def run(self, pipeline: Pipeline, ctx: RequestContext) -> Done | Error:
        return await final_event(self.stream(pipeline, ctx))

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (or *timeout_s*); True if drained."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


async def head_of_stream(events: AsyncIterator[Event], pipeline: Pipeline) -> list[Event]:
    """The events until the request is handed to the model (*pipeline*'s ``generate`` stage finished), the first
    text, or the end: what a streamed response's status and headers depend on. A request refused by
    policy or by an overloaded engine gets its 403 or 429, with the rate-limit headers, rather than a 200
    with an error event; the stages before the model take milliseconds. On an error the stream is
    closed here."""
    head: list[Event] = []
    try:
        async for event in events:
            head.append(event)
            if isinstance(event, Error):
                await events.aclose()  # type: ignore[attr-defined]
                break
            if isinstance(event, (TextDelta, Done)) or (
                    isinstance(event, StageFinished) and event.status == "ok" and not event.parent
                    and event.stage_id in pipeline.submit_steps):
                break
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    return head


async def with_head(head: list[Event], events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """*head* again, then the rest of *events*; closing this closes *events*."""
    try:
        for event in head:
            yield event
        if not head or not isinstance(head[-1], (Done, Error)):
            async for event in events:
                yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]


#: What every event stream of ours sends besides its own headers: no caching, and no buffering by a
#: proxy in front (nginx's X-Accel-Buffering), so that each event reaches the client as it is made.
EVENT_STREAM_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


def event_stream(chunks: AsyncIterator[bytes], headers: dict[str, str]) -> Stream:
    """A ``text/event-stream`` response of events already encoded (:func:`sse_event`).

    Not Litestar's ``ServerSentEvent``: it starts every response by running a step of a synchronous
    iterator (empty for us) in a worker thread, a hop to another thread and back per stream for nothing,
    and its encoder builds each event through a ``StringIO`` and regular expressions.
    """
    return Stream(chunks, media_type="text/event-stream", headers={**EVENT_STREAM_HEADERS, **headers})


def sse_event(event: str, payload: object) -> bytes:
    """One Server-Sent Event, its data *payload* as one line of JSON (msgspec writes no line breaks; it
    also writes UTF-8 rather than ``\\u`` escapes, and no spaces), encoded on the event loop several times
    faster than with ``json.dumps``."""
    return b"event: " + event.encode() + b"\r\ndata: " + encode_json(payload) + b"\r\n\r\n"


#: An event's data: compact JSON, UTF-8, on one line (msgspec escapes line breaks inside strings).
encode_json = msgspec.json.Encoder().encode
