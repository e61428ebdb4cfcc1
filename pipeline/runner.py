"""The runner: executes one request through one pipeline's steps, over the graph of their needs.

Steps that do not need each other run at the same time; a chain runs one step after another, as it always
did (pipeline/steps.py has the scheduling and each step's semantics: ``when:``, ``always``, ``timeout_s``,
``retry:``, ``fallback:``, ``on_error``). A :class:`~pipeline.errors.PolicyDenied` denies the request.

Cancelling the request (the caller stops iterating, or its task is cancelled)
cancels the running steps; the ``always`` steps still run before the
cancellation completes. Events come out of :meth:`Runner.stream`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from pipeline import tracing as attr
from pipeline.context import ChatMessage, RequestContext, sources_of
from pipeline.digest import digest
from pipeline.eager import start_eagerly
from pipeline.errors import InferlineError
from pipeline.events import Done, Error, Event, Summary, final_event
from pipeline.flow import reads_of
from pipeline.loader import LoadedPipeline
from pipeline.protocols import Resources
from pipeline.steps import BoundStage, Clock, Emit, run_steps

logger = logging.getLogger(__name__)


class Pipeline:
    """A loaded pipeline with its stages instantiated over live resources."""

    def __init__(self, loaded: LoadedPipeline, resources: Resources | None = None, *, versioned: bool = True):
        """*versioned*: a version the server keeps (its steps pin their tools with it); False for a pipeline
        built for one request."""
        self.loaded = loaded
        self.spec = loaded.spec
        self.name = loaded.spec.name
        resources = resources or Resources()
        if loaded.graph is None:
            raise ValueError(f"pipeline {loaded.spec.name!r} was loaded without its graph")
        self.graph = loaded.graph
        answering = answering_steps(loaded)
        #: A workflow: only its answering steps' text goes out. A chain (it answers through a stream stage, or
        #: makes no model call at all) sends every stage's text, as it always did.
        self.answers = bool(answering) or (
            not any(plan.cls.answers_chain for plan in loaded.plans)
            and any(plan.cls.is_model_call for plan in loaded.plans))
        answering_ids = answering | {self.graph.fallbacks[step] for step in answering  # in its place
                                     if step in self.graph.fallbacks}
        #: The steps whose text is the client's answer: a workflow's answering steps (and their fallbacks), the
        #: stage that sends a chain's (``stream``) or a fixed one (``reply``).
        self.answer_steps = answering_ids | {plan.spec.id for plan in loaded.plans if plan.cls.sends_answer}
        #: The steps that hand a chain's prompt to its model and leave the tokens to a later stage (``generate``):
        #: once one has, a streamed response may start before the first token.
        self.submit_steps = frozenset(plan.spec.id for plan in loaded.plans if "token_stream" in plan.cls.writes)
        records_io = any(plan.cls.records_steps for plan in loaded.plans)
        self.stages = tuple(
            BoundStage(plan, plan.cls(plan.spec.id, plan.config, resources),
                       not self.answers or plan.cls.sends_answer or plan.spec.id in answering_ids,
                       records_io, digest(plan.spec.model_dump(mode="json", by_alias=True, exclude_none=True)),
                       *reads_of(plan))
            for plan in loaded.plans
        )
        self._by_id = {bound.plan.spec.id: bound for bound in self.stages}
        if versioned:
            for bound in self.stages:
                bound.stage.version = (self.name, loaded.sha256)
        #: Requests running on this pipeline now: a version replaced by a reload is closed once it is 0.
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    def step(self, step_id: str) -> BoundStage:
        return self._by_id[step_id]

    # What the HTTP routes ask of a pipeline, whether its answer comes from a chain or from a workflow's step:
    # each is answered by the step types' own declarations (pipeline/stage.py), never by their type names.

    @property
    def embeds(self) -> bool:
        """Whether it answers with vectors (a step writes ``embeddings``) rather than with text."""
        return any("embeddings" in plan.cls.writes for plan in self.loaded.plans)

    @property
    def embedding_model(self) -> str | None:
        """The model its embedding step names (None: it makes no embeddings)."""
        return next((plan.cls.model_of(plan.config) for plan in self.loaded.plans if "embeddings" in plan.cls.writes),
                    None)

    @property
    def answer_model(self) -> str | None:
        """The model its answer's prompt is encoded for, as its file names it: the answering step's (an ``llm``
        step's ``model:``), else the step's that encodes a chain's prompt (``tokenize``); None when it leaves the
        model to a route or to the server's first."""
        steps = self._answering_then("prompt_ids")
        return next((model for bound in steps if (model := bound.plan.cls.model_of(bound.plan.config))), None)

    def prompt_for(self, ctx: RequestContext) -> list[ChatMessage] | None:
        """The messages its answer's model call is sent for *ctx* as it stands (nothing retrieved yet, and the
        outputs of steps that have not run read as empty): the answering step's prompt, else that of the step
        that builds a chain's (``prompt``); None when no step builds one (the client's messages are the prompt)."""
        return next((messages for bound in self._answering_then("messages")
                     if (messages := bound.stage.prompt(ctx)) is not None), None)

    def resumes_at(self, step_id: str) -> bool:
        """Whether a request paused for approval at step *step_id* can resume on this pipeline (it has a step of
        that id that pauses)."""
        bound = self._by_id.get(step_id)
        return bound is not None and bound.plan.cls.pauses_for_approval

    def _answering_then(self, field: str) -> list[BoundStage]:
        """The answering steps, then the steps that write flow field *field*, in file order."""
        return [bound for bound in self.stages if bound.plan.spec.id in self.answer_steps] + \
            [bound for bound in self.stages if field in bound.plan.cls.writes]

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

    def start(self) -> None:
        """Let stages that prepare before their first request start it (an ``agent`` step pins its MCP tools), in
        a running loop: when the server starts serving a version it built before its loop ran."""
        for bound in self.stages:
            bound.stage.start()

    async def aclose(self) -> None:
        """Let stages that hold connections (a cache's Redis client) close them; at shutdown."""
        for bound in self.stages:
            close = getattr(bound.stage, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # one stage failing to close must not keep the others open
                    logger.exception("stage %s: closing failed", bound.stage.id)


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
        clock = Clock()
        span_attrs = {attr.PIPELINE_NAME: pipeline.name, attr.PIPELINE_VERSION: pipeline.spec.version,
                      attr.REQUEST_ID: ctx.request_id, attr.GEN_AI_OPERATION_NAME: ctx.operation}
        with self.tracer.start_as_current_span(f"pipeline {pipeline.name}", attributes=span_attrs) as span:
            ctx.trace_id = format(span.get_span_context().trace_id, "032x")
            ctx.pipeline_version, ctx.spec_sha256 = pipeline.spec.version, pipeline.loaded.sha256
            cancelled = await run_steps(pipeline, ctx, emit, clock, self.tracer, span)
            cancelled |= await _finalize(ctx)
            _close_request_span(span, ctx, self.capture_content)
            emit(_final(pipeline, ctx, clock))
        if cancelled:
            raise asyncio.CancelledError


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


def _final(pipeline: Pipeline, ctx: RequestContext, clock: Clock) -> Done | Error:
    now = time.perf_counter()
    summary = Summary(
        request_id=ctx.request_id, trace_id=ctx.trace_id, pipeline=pipeline.name,
        duration_s=now - clock.start,
        ttft_s=None if clock.first_token is None else clock.first_token - clock.start,
        cost_usd=ctx.ledger.total_usd, stages=tuple(ctx.stages), usage=ctx.usage,
        output_text=ctx.output_text, finish_reason=ctx.finish_reason, sources=sources_of(ctx.documents),
        pipeline_version=pipeline.spec.version, spec_sha256=pipeline.loaded.sha256, choices=tuple(ctx.choices),
        logprobs=tuple(ctx.logprobs),
        last_token_s=max((s.started_s + s.duration_s for s in ctx.stages
                          if s.id in pipeline.answer_steps and not s.parent and s.status == "ok"), default=None),
    )
    if ctx.status == "ok":
        return Done(summary)
    failed = next((s for s in ctx.stages if s.status in ("failed", "timeout", "denied", "cancelled")), None)
    message = _message(ctx.error) if ctx.error is not None else "the request was cancelled"
    return Error(ctx.status, _kind(ctx.error), message, failed.id if failed else "", summary)


def answering_steps(loaded: LoadedPipeline) -> frozenset[str]:
    """The steps whose text is the client's answer: those that say ``stream: true``; else, in a pipeline with no
    stage that sends a chain's answer (``stream``), its model calls (``llm``) that no other step reads (the
    branches of a switch are alternatives: the first to send text answers). None of them: every stage's text
    goes out, as in a chain."""
    graph = loaded.graph
    if graph is None or graph.streaming:
        return frozenset(graph.streaming if graph is not None else ())
    if any(plan.cls.answers_chain for plan in loaded.plans):
        return frozenset()
    read = {step for plan in loaded.plans for step, _ in reads_of(plan)[1]}
    return frozenset(plan.spec.id for plan in loaded.plans if plan.cls.is_model_call
                     and plan.spec.id not in graph.fallback_only and plan.spec.id not in read)
