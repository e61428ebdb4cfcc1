"""The console's memory of recent requests: their traces, for the trace view.

:class:`RecordingRunner` sits between the executor and the runner and, as each
request ends (answered, refused, failed or disconnected), keeps a
:class:`TraceEntry` in a bounded :class:`TraceRing`: the stages with their
start offsets, durations, costs and decisions, TTFT, tokens, model, the
documents retrieved and the policy decisions. Never the prompt or the answer:
an entry is what a trace span would carry. Older requests are read back from
their audit record instead (serving/console/trace_view.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pipeline.context import RequestContext, StageRecord
from pipeline.events import Done, Error, Event, final_event
from pipeline.runner import Pipeline, Runner

logger = logging.getLogger(__name__)

#: Facts worth showing in a trace (see stages/*.py); never content.
_FACT_KEYS = ("route", "retrieval", "policy", "cache", "sampling")


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One finished request, as the trace view draws it."""

    request_id: str
    trace_id: str
    pipeline: str
    received_at: datetime
    status: str
    duration_ms: float
    ttft_ms: float | None
    cost_usd: float
    input_tokens: int
    output_tokens: int
    prompt_tokens: int
    model: str
    finish_reason: str
    key_id: str | None
    role: str | None
    stages: tuple[StageRecord, ...]
    facts: dict[str, Any] = field(default_factory=dict)
    #: Each stage's own summary of what it decided, by stage id (``ctx.facts["decisions"]``).
    decisions: dict[str, Any] = field(default_factory=dict)


class TraceRing:
    """The last *capacity* requests' traces, found by trace id or request id. Event-loop only."""

    def __init__(self, capacity: int = 500):
        self.capacity = capacity
        self._entries: OrderedDict[str, TraceEntry] = OrderedDict()
        self._by_request: dict[str, str] = {}

    def add(self, entry: TraceEntry) -> None:
        self._entries[entry.trace_id] = entry
        self._entries.move_to_end(entry.trace_id)
        self._by_request[entry.request_id] = entry.trace_id
        while len(self._entries) > self.capacity:
            _, old = self._entries.popitem(last=False)
            self._by_request.pop(old.request_id, None)

    def get(self, ident: str) -> TraceEntry | None:
        """The entry whose trace id or request id is *ident*."""
        return self._entries.get(ident) or self._entries.get(self._by_request.get(ident, ""))

    def recent(self, limit: int = 100, key_id: str | None = None, everyone: bool = True) -> list[TraceEntry]:
        """Newest first; only *key_id*'s own requests unless *everyone*."""
        out: list[TraceEntry] = []
        for entry in reversed(self._entries.values()):
            if everyone or (key_id is not None and entry.key_id == key_id):
                out.append(entry)
                if len(out) >= limit:
                    break
        return out

    def __len__(self) -> int:
        return len(self._entries)


class RecordingRunner:
    """A :class:`~pipeline.runner.Runner` that also leaves each request's trace in a ring."""

    def __init__(self, inner: Runner, ring: TraceRing):
        self.inner = inner
        self.ring = ring

    @property
    def tracer(self) -> Any:
        return self.inner.tracer

    async def run(self, pipeline: Pipeline, ctx: RequestContext) -> Done | Error:
        """Run to the end and return the final event (recorded like a stream)."""
        return await final_event(self.stream(pipeline, ctx))

    async def stream(self, pipeline: Pipeline, ctx: RequestContext) -> AsyncIterator[Event]:
        """The runner's events, unchanged; the trace is kept however the stream ends."""
        events = self.inner.stream(pipeline, ctx)
        final: Done | Error | None = None
        try:
            async for event in events:
                if isinstance(event, (Done, Error)):
                    final = event
                yield event
        finally:
            # Closing the inner stream is what cancels the request on a disconnect: do it now,
            # not whenever this generator is collected. The always-stages run inside it.
            await events.aclose()  # type: ignore[attr-defined]
            try:
                self.ring.add(entry_of(ctx, final))
            except Exception:  # the console's bookkeeping must never fail a request
                logger.exception("console: could not keep the trace of request %s", ctx.request_id)


def entry_of(ctx: RequestContext, final: Done | Error | None) -> TraceEntry:
    """The trace of *ctx*, finished with *final* (None: the client went away before the end)."""
    summary = final.summary if final is not None else None
    stages = tuple(ctx.stages)
    if summary is not None:
        duration_ms = summary.duration_s * 1e3
    else:
        duration_ms = max((s.started_s + s.duration_s for s in stages), default=0.0) * 1e3
    status = {"cancelled": "disconnected"}.get(ctx.status, ctx.status)
    principal = ctx.principal
    return TraceEntry(
        request_id=ctx.request_id, trace_id=ctx.trace_id or ctx.request_id, pipeline=ctx.pipeline,
        received_at=ctx.received_at, status=status, duration_ms=duration_ms,
        ttft_ms=None if ctx.ttft_s is None else ctx.ttft_s * 1e3, cost_usd=ctx.ledger.total_usd,
        input_tokens=ctx.usage.input_tokens, output_tokens=ctx.usage.output_tokens,
        prompt_tokens=ctx.prompt_tokens, model=ctx.model, finish_reason=ctx.finish_reason,
        key_id=principal.key_id if principal else None, role=principal.role if principal else None,
        stages=stages, facts={k: ctx.facts[k] for k in _FACT_KEYS if k in ctx.facts},
        decisions=dict(ctx.facts.get("decisions", {})))
