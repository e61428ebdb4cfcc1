"""The runner: executes one request through one pipeline's stages, in order.

Semantics, per stage:

* ``when:`` false → skipped;
* an earlier stage failed, was denied or the request was cancelled → skipped,
  unless the stage is ``always: true`` (audit), which runs regardless;
* ``timeout_s`` → the stage is cancelled and counts as failed (``timeout``);
* a failure with ``on_error: skip`` is recorded and the request goes on;
  with ``on_error: fail`` (the default) the request fails;
* :class:`~pipeline.errors.PolicyDenied` denies the request.

Cancelling the request (the caller stops iterating, or its task is cancelled)
cancels the running stage; the ``always`` stages still run before the
cancellation completes. Events come out of :meth:`Runner.stream`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from pipeline import tracing as attr
from pipeline.context import RequestContext, StageRecord, TokenLogprob, sources_of
from pipeline.eager import start_eagerly
from pipeline.errors import ExpressionError, InferlineError, PolicyDenied, StageTimeout
from pipeline.events import Done, Error, Event, StageFinished, StageStarted, Summary, TextDelta, final_event
from pipeline.loader import LoadedPipeline, StagePlan
from pipeline.protocols import Resources
from pipeline.spec import StageSpec
from pipeline.stage import Stage

Emit = Callable[[Event], None]
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BoundStage:
    """A stage instance with its plan."""

    plan: StagePlan
    stage: Stage


class Pipeline:
    """A loaded pipeline with its stages instantiated over live resources."""

    def __init__(self, loaded: LoadedPipeline, resources: Resources | None = None):
        self.loaded = loaded
        self.spec = loaded.spec
        self.name = loaded.spec.name
        resources = resources or Resources()
        self.stages = tuple(
            BoundStage(plan, plan.cls(plan.spec.id, plan.config, resources)) for plan in loaded.plans
        )
        #: Requests running on this pipeline now: a version replaced by a reload is closed once it is 0.
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    async def idle(self) -> None:
        """Return once no request runs on this pipeline."""
        while self.in_flight:
            self._idle = self._idle or asyncio.Event()
            await self._idle.wait()

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def aclose(self) -> None:
        """Let stages that hold connections (a cache's Redis client) close them; at shutdown."""
        for bound in self.stages:
            close = getattr(bound.stage, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # one stage failing to close must not keep the others open
                    logger.exception("stage %s: closing failed", bound.stage.id)


class _Scope:
    """The :class:`~pipeline.stage.StageScope` given to one running stage."""

    __slots__ = ("_clock", "_ctx", "_emit", "_span", "_stage_id")

    def __init__(self, ctx: RequestContext, stage_id: str, span: Span, emit: Emit, clock: _Clock):
        self._ctx, self._stage_id, self._span, self._emit, self._clock = ctx, stage_id, span, emit, clock

    async def emit_text(self, text: str, index: int = 0, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if text:
            self._clock.mark_first_token(self._ctx)
        if text or logprobs:
            self._emit(TextDelta(text, self._stage_id, index, logprobs))

    def add_cost(self, usd: float, kind: str = "other", detail: str = "") -> None:
        self._ctx.ledger.add(self._stage_id, usd, kind, detail)

    def set_attribute(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        self._span.add_event(name, attributes)


class _Clock:
    __slots__ = ("first_token", "start")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token: float | None = None

    def mark_first_token(self, ctx: RequestContext) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
            ctx.ttft_s = self.first_token - self.start


class Runner:
    """Runs requests; one runner can serve every pipeline of a process."""

    def __init__(self, tracer: Tracer | None = None, *, capture_content: bool = False):
        self.tracer = tracer or trace.get_tracer("inferline.pipeline")
        #: Message content on request spans (OpenTelemetry's opt-in ``gen_ai.*.messages``).
        self.capture_content = capture_content

    async def run(self, pipeline: Pipeline, ctx: RequestContext) -> Done | Error:
        """Run to the end and return the final event."""
        return await final_event(self.stream(pipeline, ctx))

    async def stream(self, pipeline: Pipeline, ctx: RequestContext) -> AsyncIterator[Event]:
        """Events of one request, as they happen; the last is :class:`Done` or :class:`Error`."""
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        # Started here, in the caller's step, rather than behind whatever else the loop has ready: in a
        # burst, that is every other request's HTTP handling (pipeline/eager.py).
        task = start_eagerly(self._execute(pipeline, ctx, queue.put_nowait))
        # A None after the task ends unblocks us should the task die of a bug
        # before it could emit its final event.
        task.add_done_callback(lambda _: queue.put_nowait(None))
        pipeline.in_flight += 1
        try:
            while (event := await queue.get()) is not None:
                yield event
                if isinstance(event, (Done, Error)):
                    return
            task.result()  # re-raises the bug that ended the task early
        finally:
            if not task.done():
                task.cancel()
            # Wait for the always-stages (audit) even if our caller is being cancelled.
            try:
                await asyncio.wait([task])
            finally:
                pipeline.request_ended()

    async def _execute(self, pipeline: Pipeline, ctx: RequestContext, emit: Emit) -> None:
        clock = _Clock()
        cancelled = False
        span_attrs = {attr.PIPELINE_NAME: pipeline.name, attr.PIPELINE_VERSION: pipeline.spec.version,
                      attr.REQUEST_ID: ctx.request_id, attr.GEN_AI_OPERATION_NAME: ctx.operation}
        with self.tracer.start_as_current_span(f"pipeline {pipeline.name}", attributes=span_attrs) as span:
            ctx.trace_id = format(span.get_span_context().trace_id, "032x")
            ctx.pipeline_version, ctx.spec_sha256 = pipeline.spec.version, pipeline.loaded.sha256
            for bound in pipeline.stages:
                try:
                    await self._stage(bound, ctx, emit, clock, span)
                except asyncio.CancelledError:
                    cancelled = True
                    if ctx.status == "ok":
                        ctx.status, ctx.error = "cancelled", None
                    _uncancel()
            cancelled |= await _finalize(ctx)
            _close_request_span(span, ctx, self.capture_content)
            emit(_final(pipeline, ctx, clock))
        if cancelled:
            raise asyncio.CancelledError

    async def _stage(self, bound: BoundStage, ctx: RequestContext, emit: Emit, clock: _Clock,
                     request_span: Span) -> None:
        spec = bound.plan.spec
        try:
            runs = (ctx.status == "ok" or spec.always) and (
                bound.plan.when is None or bool(bound.plan.when.evaluate(ctx.field_value)))
        except ExpressionError as exc:
            runs, fault = False, exc
        else:
            fault = None
        if not runs:
            status, error = ("skipped", "") if fault is None else _fail(bound, ctx, fault, None)
            _record(ctx, emit, spec, status, time.perf_counter() - clock.start, 0.0, error)
            return
        emit(StageStarted(spec.id, spec.type))
        with self._stage_span(spec, request_span) as span:
            started = time.perf_counter()
            status, error = "ok", ""
            try:
                await _call(bound.stage, ctx, _Scope(ctx, spec.id, span, emit, clock), spec.timeout_s)
            except asyncio.CancelledError:
                status = "cancelled"
                raise
            except Exception as exc:  # every failure is recorded, then judged by on_error
                status, error = _fail(bound, ctx, exc, span)
            finally:
                duration = time.perf_counter() - started
                span.set_attribute(attr.STAGE_STATUS, status)
                span.set_attribute(attr.COST_USD, ctx.ledger.stage_total(spec.id))
                _record(ctx, emit, spec, status, started - clock.start, duration, error)

    def _stage_span(self, spec: StageSpec, request_span: Span) -> AbstractContextManager[Span]:
        """The stage's span, current while it runs. Under a request span that records nothing (no
        exporter), the request's own no-op span: a stage span would record nothing either, and still
        cost the event loop's time to make and make current."""
        if not request_span.is_recording():
            return nullcontext(request_span)
        return self.tracer.start_as_current_span(f"stage {spec.id}",
                                                 attributes={attr.STAGE_ID: spec.id, attr.STAGE_TYPE: spec.type},
                                                 record_exception=False, set_status_on_exception=False)


async def _finalize(ctx: RequestContext) -> bool:
    """Run every finalizer, each to its end even if the request is cancelled meanwhile (they settle
    budgets); True if a cancellation arrived while they ran."""
    cancelled = False
    for finalizer in ctx.finalizers:
        task = asyncio.ensure_future(finalizer(ctx))
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True
                _uncancel()
            except Exception:  # a finalizer's failure must not lose the request's final event
                logger.exception("request %s: a finalizer failed", ctx.request_id)
    return cancelled


def _record(ctx: RequestContext, emit: Emit, spec: StageSpec, status: str, started_s: float,
            duration_s: float, error: str) -> None:
    cost = ctx.ledger.stage_total(spec.id) if status != "skipped" else 0.0
    ctx.stages.append(StageRecord(spec.id, spec.type, status, started_s, duration_s, cost, error))
    emit(StageFinished(spec.id, spec.type, status, duration_s, cost, error))


async def _call(stage: Stage, ctx: RequestContext, scope: _Scope, timeout_s: float | None) -> None:
    if timeout_s is None:
        await stage.run(ctx, scope)
        return
    try:
        async with asyncio.timeout(timeout_s):
            await stage.run(ctx, scope)
    except TimeoutError:
        raise StageTimeout(stage.id, f"stage {stage.id!r} timed out after {timeout_s:g} s") from None


def _fail(bound: BoundStage, ctx: RequestContext, exc: Exception, span: Span | None) -> tuple[str, str]:
    """Record *exc* on the span and the context; return (status, message)."""
    message = _message(exc)
    if span is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, message))
    if isinstance(exc, PolicyDenied):
        if ctx.status == "ok":
            ctx.status, ctx.error = "denied", exc
        return "denied", message
    status = "timeout" if isinstance(exc, StageTimeout) else "failed"
    if bound.plan.spec.on_error == "fail" and ctx.status == "ok":
        ctx.status, ctx.error = "failed", exc
    return status, message


def _message(exc: BaseException) -> str:
    if isinstance(exc, InferlineError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _kind(exc: BaseException | None) -> str:
    if exc is None:
        return "cancelled"
    return exc.kind if isinstance(exc, InferlineError) else "stage_error"


def _uncancel() -> None:
    # Python 3.11 counts cancel requests; once handled, clear ours so that the
    # always-stages' own timeouts still work (asyncio.timeout checks the count).
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _close_request_span(span: Span, ctx: RequestContext, capture_content: bool = False) -> None:
    span.set_attribute(attr.REQUEST_STATUS, ctx.status)
    span.set_attribute(attr.COST_USD, ctx.ledger.total_usd)
    if capture_content and span.is_recording():  # the GenAI conventions' JSON shapes of messages
        span.set_attribute(attr.GEN_AI_INPUT_MESSAGES, json.dumps(
            [{"role": m.role, "parts": [{"type": "text", "content": m.content}]} for m in ctx.input_messages],
            ensure_ascii=False))
        span.set_attribute(attr.GEN_AI_OUTPUT_MESSAGES, json.dumps(
            [{"role": "assistant", "parts": [{"type": "text", "content": ctx.output_text}],
              "finish_reason": ctx.finish_reason or ctx.status}], ensure_ascii=False))
    if ctx.status != "ok":
        span.set_status(Status(StatusCode.ERROR, ctx.status))


def _final(pipeline: Pipeline, ctx: RequestContext, clock: _Clock) -> Done | Error:
    now = time.perf_counter()
    summary = Summary(
        request_id=ctx.request_id, trace_id=ctx.trace_id, pipeline=pipeline.name,
        duration_s=now - clock.start,
        ttft_s=None if clock.first_token is None else clock.first_token - clock.start,
        cost_usd=ctx.ledger.total_usd, stages=tuple(ctx.stages), usage=ctx.usage,
        output_text=ctx.output_text, finish_reason=ctx.finish_reason, sources=sources_of(ctx.documents),
        pipeline_version=pipeline.spec.version, spec_sha256=pipeline.loaded.sha256, choices=tuple(ctx.choices),
        logprobs=tuple(ctx.logprobs),
    )
    if ctx.status == "ok":
        return Done(summary)
    failed = next((s for s in ctx.stages if s.status in ("failed", "timeout", "denied", "cancelled")), None)
    message = _message(ctx.error) if ctx.error is not None else "the request was cancelled"
    return Error(ctx.status, _kind(ctx.error), message, failed.id if failed else "", summary)
