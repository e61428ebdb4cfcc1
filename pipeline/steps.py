"""One request's steps, run over the pipeline's graph (pipeline/graph.py): what :class:`~pipeline.runner.Runner`
does between the request's span opening and its final event.

Scheduling: the steps whose needs have all ended start; a step that is alone in being ready while nothing runs
is run in the request's own task (a chain costs what it did before graphs), otherwise each ready step runs in a
task of its own, started eagerly (pipeline/eager.py). Per step:

* ``when:`` false -> skipped (reason ``when``); an earlier step failed, was denied, or the request was cancelled
  -> skipped (``failed``), unless the step is ``always: true``; a step answered and ended the request (``reply``)
  -> skipped (``ended``), ``always`` steps still running;
* each attempt runs under ``timeout_s``, in a span of its own under the request's; a failure its ``retry:``
  covers (error, timeout, invalid_output, empty) runs it again after ``backoff_ms`` (doubling), unless its text
  already reached the client; then its ``fallback:`` runs in its place; then ``on_error`` judges it;
* a failure with ``on_error: fail`` (or a denial) cancels the steps running beside it.

Each attempt is a :class:`~pipeline.context.StageRecord` and a pair of events; each step's outputs land in
``ctx.steps[ID]`` for the steps after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.trace import Span, Status, StatusCode, Tracer

from pipeline import tracing as attr
from pipeline.context import CURRENT_ITEM, RequestContext, StageRecord, TokenLogprob, step_key
from pipeline.digest import digest, jsonable
from pipeline.eager import finished_eagerly, start_eagerly
from pipeline.errors import (
    EmptyOutput,
    ExpressionError,
    InferlineError,
    InvalidInput,
    InvalidOutput,
    PolicyDenied,
    StageTimeout,
)
from pipeline.events import Event, StageFinished, StageStarted, TextDelta
from pipeline.graph import Graph
from pipeline.plan import StagePlan
from pipeline.spec import StageSpec
from pipeline.stage import Stage

Emit = Callable[[Event], None]


@dataclass(frozen=True, slots=True)
class BoundStage:
    """A stage instance with its plan, and whether its text is the client's answer."""

    plan: StagePlan
    stage: Stage
    streams: bool = False
    #: Whether its attempts record what they read and gave (a pipeline with an audit step does).
    records_io: bool = False
    #: The SHA-256 of its definition (its entry in the file, as loaded).
    definition_sha256: str = ""
    #: The flow fields it reads, and the earlier steps' outputs (step, field).
    reads: tuple[str, ...] = ()
    step_reads: tuple[tuple[str, str], ...] = ()

    def inputs(self, ctx: RequestContext) -> dict[str, Any]:
        """What it reads, now: each flow field, and each ``steps.ID.FIELD``, as JSON values."""
        read = {name: jsonable(ctx.field_value(name)) for name in self.reads}
        return read | {f"steps.{step}.{field}": jsonable(ctx.steps.get(step, {}).get(field))
                       for step, field in self.step_reads}


class Steps(Protocol):
    """What running a request's steps needs of its pipeline (:class:`~pipeline.runner.Pipeline`)."""

    graph: Graph
    #: Whether some steps are its answer's (a workflow's), rather than every stage's text going out (a chain).
    answers: bool

    def step(self, step_id: str) -> BoundStage: ...


class Clock:
    """The request's start, and when its first text went out (its TTFT)."""

    __slots__ = ("first_token", "start")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token: float | None = None

    def mark_first_token(self, ctx: RequestContext) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
            ctx.ttft_s = self.first_token - self.start


class Scope:
    """The :class:`~pipeline.stage.StageScope` given to one attempt of one step."""

    __slots__ = ("_answer", "_clock", "_ctx", "_emit", "_span", "_stage_id", "_streams", "cost_usd", "emitted",
                 "ended", "holds_text", "input_tokens", "output_tokens")

    def __init__(self, ctx: RequestContext, stage_id: str, span: Span, emit: Emit, clock: Clock, streams: bool,
                 holds_text: bool = False, answer: _Answer | None = None):
        self._ctx, self._stage_id, self._span, self._emit, self._clock = ctx, stage_id, span, emit, clock
        self._answer = answer if streams else None
        #: Whether its text may reach the client (without an answer to share: always, as a chain's stages).
        self._streams = streams
        #: Its text must wait until its output is checked: another attempt follows an invalid or empty one.
        self.holds_text = holds_text
        #: Whether any of its text reached the client (then it is not retried).
        self.emitted = False
        #: Whether it answered the request and ended it (``reply``).
        self.ended = False
        self.input_tokens = self.output_tokens = 0
        #: What this attempt cost (an item's or a round's own, where the step's ledger adds them all up).
        self.cost_usd = 0.0

    @property
    def streams(self) -> bool:
        """Whether its text is the client's answer: it streams, and no other step that may answer has sent text
        first (the branches of a switch are alternatives; the first to send text answers)."""
        if self._answer is None:
            return self._streams
        if self._answer.step is None:
            self._answer.step = self._stage_id
        return self._answer.step == self._stage_id

    async def emit_text(self, text: str, index: int = 0, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if not self.streams:
            return
        if text:
            self._clock.mark_first_token(self._ctx)
            self.emitted = True
        if text or logprobs:
            self._emit(TextDelta(text, self._stage_id, index, logprobs))

    def add_cost(self, usd: float, kind: str = "other", detail: str = "") -> None:
        self._ctx.ledger.add(self._stage_id, usd, kind, detail)
        self.cost_usd += usd

    def set_attribute(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        self._span.add_event(name, attributes)

    def add_tokens(self, input_tokens: int, output_tokens: int) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens

    def end_request(self) -> None:
        self.ended = True

    def emit_step(self, event: StageStarted | StageFinished) -> None:
        self._emit(dataclasses.replace(event, parent=f"{self._stage_id}/{event.parent}" if event.parent
                                       else self._stage_id))


@dataclass(slots=True)
class _Answer:
    """Which of the steps that may answer a request answered it (the first to send text, or to ask)."""

    step: str | None = None


@dataclass(slots=True)
class _Run:
    """One request's run over the graph: what every step needs to know."""

    pipeline: Steps
    ctx: RequestContext
    emit: Emit
    clock: Clock
    tracer: Tracer
    request_span: Span
    #: A step answered the request and ended it: the rest (but always steps) is skipped.
    ended: bool = False
    #: In a workflow (a pipeline with answering steps), which one answered.
    answer: _Answer | None = None
    #: Each loop's round now (1 while it runs its first), by the step closing it.
    rounds: dict[str, int] = field(default_factory=dict)
    #: Each loop step's outputs, round after round.
    kept: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


async def run_steps(pipeline: Steps, ctx: RequestContext, emit: Emit, clock: Clock, tracer: Tracer,
                    request_span: Span) -> bool:
    """Run every step of *pipeline* for *ctx*; True if the request was cancelled meanwhile (the ``always``
    steps ran all the same)."""
    run = _Run(pipeline, ctx, emit, clock, tracer, request_span, answer=_Answer() if pipeline.answers else None)
    graph = pipeline.graph
    waiting = {step: len(graph.deps[step]) for step in graph.order if step not in graph.fallback_only}
    followers: dict[str, list[str]] = {step: [] for step in waiting}
    for step in waiting:
        for need in graph.deps[step]:
            followers[need].append(step)
    ready = [step for step in graph.order if step in waiting and waiting[step] == 0]
    running: dict[asyncio.Task[None], str] = {}
    cancelled = False

    def finished(step: str) -> None:
        if step in graph.loops and _again(run, pipeline.step(step)):  # the loop's next round: its steps again
            body = graph.loops[step]
            for member in body:
                waiting[member] = sum(need in body for need in graph.deps[member])
            ready.extend(member for member in body if waiting[member] == 0)
            return
        for follower in followers[step]:
            waiting[follower] -= 1
            if waiting[follower] == 0:
                ready.append(follower)

    while ready or running:
        if len(ready) == 1 and not running:  # a chain's step: in this task, as a stage always ran
            step = ready.pop()
            try:
                await _step(run, pipeline.step(step))
            except asyncio.CancelledError:
                cancelled = _cancelled(ctx)
            finished(step)
            continue
        if ready:  # one at a time: the last one ready, with nothing running, runs in this task (above)
            step = ready.pop(0)
            task = start_eagerly(_step(run, pipeline.step(step)))
            if finished_eagerly(task):
                finished(step)  # it ran to its end during its start (a step that waits on nothing)
            else:
                running[task] = step
            continue
        try:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            cancelled = _cancelled(ctx)
            done = set(await _cancel_all(running, lambda _: True))
        for task in done:
            finished(running.pop(task))
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug in the runner: let it end the request
        if ctx.status != "ok":  # a failure or a denial: the steps beside it are not needed any more
            for task in await _cancel_all(running, lambda name: not pipeline.step(name).plan.spec.always):
                finished(running.pop(task))
    return cancelled


def _cancelled(ctx: RequestContext) -> bool:
    if ctx.status == "ok":
        ctx.status, ctx.error = "cancelled", None
    task = asyncio.current_task()
    if task is not None:  # 3.11 counts cancel requests: clear ours so the always steps' own timeouts work
        task.uncancel()
    return True


async def _cancel_all(running: dict[asyncio.Task[None], str], which: Callable[[str], bool]) -> list[asyncio.Task[None]]:
    """Cancel the running steps *which* selects and wait for them (each records itself as cancelled)."""
    chosen = [task for task, name in running.items() if which(name)]
    for task in chosen:
        task.cancel()
    if chosen:
        await asyncio.wait(chosen)
    return chosen


def _again(run: _Run, closer: BoundStage) -> bool:
    """After a round of the loop *closer* closes: whether another follows (its until does not hold yet, every
    step went well, and it has rounds left); a failing until fails the request."""
    ctx, spec = run.ctx, closer.plan.spec
    done = run.rounds.get(spec.id, 1)
    if ctx.status != "ok" or closer.plan.until is None or spec.repeat is None or done >= spec.repeat.max:
        return False
    try:
        if closer.plan.until.evaluate(ctx.field_value):
            return False
    except ExpressionError as exc:
        _fail(ctx, exc, None, "fail")
        return False
    run.rounds[spec.id] = done + 1
    return True


async def _step(run: _Run, bound: BoundStage) -> None:
    """One step: skipped, its items (for_each), or its attempts, then its fallback; its outputs in ``ctx.steps``
    (with every round's, in a loop)."""
    ctx, spec = run.ctx, bound.plan.spec
    reason = _skip_reason(run, bound)
    if reason:
        _skipped(run, spec, reason)
        _keep_round(run, spec.id, ctx.steps[spec.id])
        return
    if spec.for_each is not None:
        outputs, status = await _items(run, bound)
    else:
        fallback = run.pipeline.graph.fallbacks.get(spec.id)
        # With a fallback, the step's own failure is not the request's: its fallback's, if that fails too, is.
        outputs, status = await _attempts(run, bound, "", judge=fallback is None, on_error=spec.on_error)
        if status not in ("ok", "cancelled", "denied") and fallback is not None:
            outputs, status = await _attempts(run, run.pipeline.step(fallback), spec.id, judge=True,
                                              on_error=spec.on_error)
            ctx.steps[fallback] = {"status": status, **outputs}
    ctx.steps[spec.id] = {"status": status, **outputs}
    _keep_round(run, spec.id, ctx.steps[spec.id])


def _keep_round(run: _Run, step: str, outputs: dict[str, Any]) -> None:
    """In a loop, the step's outputs of every round so far, as ``steps.ID.rounds``."""
    loop = run.pipeline.graph.loop_of(step)
    if loop is None:
        return
    rounds = run.kept.setdefault(step, [])
    rounds.append(dict(outputs))
    outputs["rounds"] = list(rounds)


async def _items(run: _Run, bound: BoundStage) -> tuple[dict[str, Any], str]:
    """A for_each step: each item of its list, at most ``concurrency`` at a time, in tasks of their own; its
    outputs are lists in the items' order (null for an item that failed and was skipped)."""
    ctx, spec = run.ctx, bound.plan.spec
    items = _resolve(ctx, spec.for_each or "")
    if not isinstance(items, (list, tuple)):
        _fail(ctx, InvalidInput(f"for_each: {spec.for_each} is not a list here"), None, spec.on_error)
        _record(run, spec, "failed", time.perf_counter() - run.clock.start, 0.0, f"{spec.for_each} is not a list", 1,
                "", "")
        return {}, "failed"
    gate = asyncio.Semaphore(spec.concurrency)
    results: list[tuple[dict[str, Any], str]] = [({}, "skipped")] * len(items)

    async def one(index: int, item: Any) -> None:
        async with gate:
            if ctx.status != "ok":
                return
            CURRENT_ITEM.set((index, item))
            results[index] = await _attempts(run, bound, "", judge=True, on_error=spec.on_error, item=index)

    tasks = [start_eagerly(one(index, item)) for index, item in enumerate(items)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    names = list(bound.plan.outputs) if bound.plan.outputs else sorted({k for o, _ in results for k in o})
    outputs = {name: [o.get(name) if status == "ok" else None for o, status in results] for name in names
               if name not in ("status", "rounds")}
    failed = any(status not in ("ok", "skipped") for _, status in results)
    return outputs, "failed" if failed and spec.on_error == "fail" else "ok"


def _resolve(ctx: RequestContext, dotted: str) -> Any:
    """The value at a path like ``steps.split.chunks``."""
    parts = dotted.split(".")
    value: Any = ctx.field_value(parts[0])
    for part in parts[1:]:
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


def _skip_reason(run: _Run, bound: BoundStage) -> str:
    """Why the step does not run ('' when it does); a ``when:`` that fails to evaluate fails the step."""
    ctx, spec, plan = run.ctx, bound.plan.spec, bound.plan
    if not spec.always:
        if ctx.status != "ok":
            return "failed"
        if run.ended:
            return "ended"
    if plan.when is None:
        return ""
    try:
        return "" if plan.when.evaluate(ctx.field_value) else "when"
    except ExpressionError as exc:
        _fail(ctx, exc, None, spec.on_error)
        _record(run, spec, "failed", time.perf_counter() - run.clock.start, 0.0, _message(exc), 1, "", "")
        return "error"


def _skipped(run: _Run, spec: StageSpec, reason: str) -> None:
    if reason != "error":  # a when: that failed was recorded as a failure
        _record(run, spec, "skipped", time.perf_counter() - run.clock.start, 0.0, "", 1, reason, "")
    run.ctx.steps[spec.id] = {"status": "skipped" if reason != "error" else "failed"}


async def _attempts(run: _Run, bound: BoundStage, fallback_for: str, *, judge: bool,
                    on_error: str, item: int | None = None) -> tuple[dict[str, Any], str]:
    """Run the step until an attempt succeeds or its ``retry:`` gives up; its outputs and last status. The last
    failure fails the request when *judge* and *on_error* say so (``on_error: fail``)."""
    retry = bound.plan.spec.retry
    attempts = retry.attempts if retry is not None else 1
    for attempt in range(1, attempts + 1):
        outputs, status, retrying = await _attempt(run, bound, attempt, fallback_for, attempt < attempts,
                                                   judge, on_error, item)
        if not retrying:
            return outputs, status
        await asyncio.sleep(retry.backoff_ms * 2 ** (attempt - 1) / 1000)  # type: ignore[union-attr]
    return {}, "failed"  # unreachable: the last attempt does not retry


async def _attempt(run: _Run, bound: BoundStage, attempt: int, fallback_for: str, more: bool, judge: bool,
                   on_error: str, item: int | None = None) -> tuple[dict[str, Any], str, bool]:
    """One attempt (*more*: another may follow): its outputs, status, and whether its ``retry:`` runs it again
    (a failure it covers, and none of its text reached the client)."""
    ctx, spec = run.ctx, bound.plan.spec
    covered = spec.retry.on if spec.retry is not None and more else ()
    run.emit(StageStarted(spec.id, spec.type, attempt))
    loop = run.pipeline.graph.loop_of(spec.id)
    loop_round = run.rounds.get(loop, 1) if loop else None
    with _span(run, spec, attempt, item, loop_round) as span:
        started = time.perf_counter()
        scope = Scope(ctx, spec.id, span, run.emit, run.clock, bound.streams,
                      bound.streams and bool({"invalid_output", "empty"} & set(covered)), run.answer)
        status, error, retrying, outputs = "ok", "", False, {}
        key = step_key(spec.id, item, loop_round or 1)
        reusable = ctx.reuse.get(key) if bound.plan.cls.Outputs is not None else None
        inputs = bound.inputs(ctx) if bound.records_io or reusable is not None else None
        reused = reusable is not None and reusable.definition_sha256 == bound.definition_sha256 and \
            reusable.inputs_sha256 == digest(inputs)
        try:
            if reused:
                outputs = dict(reusable.output)  # type: ignore[union-attr]
                await bound.stage.reuse(ctx, scope, outputs)
            else:
                outputs = _outputs(bound, ctx, await _call(bound.stage, ctx, scope, spec.timeout_s))
            if "empty" in covered and _is_empty(outputs) and not scope.emitted:
                status, error, retrying = "failed", "the step gave an empty output", True
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:  # every failure is recorded, then judged by retry, fallback and on_error
            retrying = _kind_of(exc) in covered and not scope.emitted
            status, error = _fail(ctx, exc, span, on_error if judge and not retrying else "skip")
        finally:
            if scope.ended:
                run.ended = True
            if run.answer is not None and run.answer.step == spec.id and status != "ok" and not scope.emitted:
                run.answer.step = None  # it sent nothing: another attempt, or its fallback, may still answer
            span.set_attribute(attr.STAGE_STATUS, status)
            span.set_attribute(attr.COST_USD, ctx.ledger.stage_total(spec.id))
            _record(run, spec, status, started - run.clock.start, time.perf_counter() - started, error, attempt, "",
                    fallback_for, scope.input_tokens, scope.output_tokens, retrying, item, scope.cost_usd)
            ctx.stages[-1].reused = reused
            if inputs is not None:
                _keep_io(ctx.stages[-1], bound, inputs, outputs if status == "ok" else None)
    return outputs, status, retrying


def _keep_io(record: StageRecord, bound: BoundStage, inputs: dict[str, Any], outputs: dict[str, Any] | None) -> None:
    record.definition_sha256, record.inputs, record.inputs_sha256 = bound.definition_sha256, inputs, digest(inputs)
    if outputs is not None:
        record.output = jsonable(outputs)
        record.output_sha256 = digest(record.output)


def _outputs(bound: BoundStage, ctx: RequestContext, produced: Any) -> dict[str, Any]:
    """The step's outputs: what ``run`` returned (its :attr:`~pipeline.stage.Stage.Outputs`), else the flow
    fields it writes, as they are now."""
    if produced is not None and dataclasses.is_dataclass(produced):
        return {f.name: getattr(produced, f.name) for f in dataclasses.fields(produced)}
    return {name: getattr(ctx, name) for name in bound.plan.cls.writes}


def _is_empty(outputs: dict[str, Any]) -> bool:
    text = outputs.get("text", outputs.get("output"))
    return isinstance(text, str) and not text.strip()


def _span(run: _Run, spec: StageSpec, attempt: int, item: int | None,
          loop_round: int | None) -> AbstractContextManager[Span]:
    """The step's span, current while it runs: its attempt, and in a loop its item or round. Under a request span
    that records nothing (no exporter), the request's own no-op span: a step span would record nothing either,
    and still cost the loop's time."""
    if not run.request_span.is_recording():
        return nullcontext(run.request_span)
    attributes: dict[str, str | int] = {attr.STAGE_ID: spec.id, attr.STAGE_TYPE: spec.type, attr.STAGE_ATTEMPT: attempt}
    if item is not None:
        attributes[attr.STAGE_ITEM] = item
    if loop_round is not None:
        attributes[attr.STAGE_ROUND] = loop_round
    return run.tracer.start_as_current_span(f"stage {spec.id}", attributes=attributes, record_exception=False,
                                            set_status_on_exception=False)


async def _call(stage: Stage, ctx: RequestContext, scope: Scope, timeout_s: float | None) -> Any:
    if timeout_s is None:
        return await stage.run(ctx, scope)
    try:
        async with asyncio.timeout(timeout_s):
            return await stage.run(ctx, scope)
    except TimeoutError:
        raise StageTimeout(stage.id, f"stage {stage.id!r} timed out after {timeout_s:g} s") from None


def _kind_of(exc: Exception) -> str:
    if isinstance(exc, PolicyDenied):
        return "denied"
    if isinstance(exc, StageTimeout):
        return "timeout"
    if isinstance(exc, InvalidOutput):
        return "invalid_output"
    if isinstance(exc, EmptyOutput):
        return "empty"
    return "error"


def _fail(ctx: RequestContext, exc: Exception, span: Span | None, on_error: str) -> tuple[str, str]:
    """Record *exc* on the span and, with *on_error* ``fail``, fail the request (a denial always denies it);
    (status, message)."""
    message = _message(exc)
    if span is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, message))
    if isinstance(exc, PolicyDenied):
        if ctx.status == "ok":
            ctx.status, ctx.error = "denied", exc
        return "denied", message
    status = "timeout" if isinstance(exc, StageTimeout) else "failed"
    if on_error == "fail" and ctx.status == "ok":
        ctx.status, ctx.error = "failed", exc
    return status, message


def _message(exc: BaseException) -> str:
    if isinstance(exc, InferlineError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _record(run: _Run, spec: StageSpec, status: str, started_s: float, duration_s: float, error: str,
            attempt: int, skip_reason: str, fallback_for: str, input_tokens: int = 0, output_tokens: int = 0,
            retrying: bool = False, item: int | None = None, cost: float = 0.0) -> None:
    ctx = run.ctx
    loop = run.pipeline.graph.loop_of(spec.id)
    ctx.stages.append(StageRecord(spec.id, spec.type, status, started_s, duration_s, cost, error, attempt,
                                  skip_reason, input_tokens, output_tokens, fallback_for, item=item,
                                  round=run.rounds.get(loop, 1) if loop is not None else 0))
    run.emit(StageFinished(spec.id, spec.type, status, duration_s, cost, error, attempt, "", skip_reason, retrying))
