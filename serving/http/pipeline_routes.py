"""Inferline's own API: every pipeline is ``POST /pipelines/{name}``.

Without streaming the answer is one JSON object; with ``"stream": true`` (or
``Accept: text/event-stream``) it is Server-Sent Events: ``stage`` events as
stages start and finish, ``delta`` events with text, and one final ``done``
(usage, cost, trace id, stages, sources) or ``error`` event.

``sources`` (in the JSON body and the ``done`` event) lists the retrieved documents the answer was
given from, best first: ``{"n", "citation", "id", "title", "path", "score"}``, where ``citation``
(``[n]``) is how the prompt numbered the document and so how the answer cites it. It is always
there: an empty list for a pipeline without a ``retrieve`` stage, or when nothing was found.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.response import Response

from pipeline.context import ChatMessage, RequestContext, Source, StageRecord
from pipeline.events import Done, Error, Event, StageFinished, StageStarted, Summary, TextDelta
from pipeline.runner import Pipeline
from serving.http import approvals
from serving.http.auth import Authenticator
from serving.http.openapi import JsonOrEventStream, problems
from serving.http.problems import Problem, bad_request, from_final, limit_headers
from serving.http.refusals import RUNS_PIPELINE, attempt_of
from serving.http.schemas import PipelineRequest
from serving.http.served import Executor, event_stream, head_of_stream, sse_event, with_head
from serving.http.services import Services
from serving.runtime.reloader import PipelineReloader


def stage_json(stage: StageRecord) -> dict[str, Any]:
    """One attempt of one step in an answer's ``stages``: as its finished ``stage`` event, with its start."""
    return {"id": stage.id, "type": stage.type, "status": stage.status,
            "started_ms": round(stage.started_s * 1e3, 3), "duration_ms": round(stage.duration_s * 1e3, 3),
            "cost_usd": stage.cost_usd, "attempt": stage.attempt, **({"error": stage.error} if stage.error else {}),
            **({"skip_reason": stage.skip_reason} if stage.skip_reason else {}),
            **({"parent": stage.parent} if stage.parent else {})}


def stage_event(event: StageStarted | StageFinished) -> dict[str, Any]:
    """A ``stage`` event's data: the step, its status and attempt; once it finished, its time and cost; and
    where they apply, its error, whether its ``retry:`` runs it again, why it was skipped, and the step it runs
    under (a sub-pipeline's)."""
    if isinstance(event, StageStarted):
        payload: dict[str, Any] = {"id": event.stage_id, "type": event.type, "status": "started",
                                   "attempt": event.attempt}
    else:
        payload = {"id": event.stage_id, "type": event.type, "status": event.status,
                   "duration_ms": round(event.duration_s * 1e3, 3), "cost_usd": event.cost_usd,
                   "attempt": event.attempt, **({"error": event.error} if event.error else {}),
                   **({"retrying": True} if event.retrying else {}),
                   **({"skip_reason": event.skip_reason} if event.skip_reason else {})}
    return payload | ({"parent": event.parent} if event.parent else {})


def source_json(source: Source) -> dict[str, Any]:
    """A document the answer was given from, and how the answer cites it (``[n]``)."""
    return {"n": source.n, "citation": source.citation, "id": source.id, "title": source.title,
            "path": source.path, "score": round(source.score, 4)}


def sources_json(summary: Summary) -> list[dict[str, Any]]:
    """The answer's sources, best first: an empty list when the pipeline retrieved nothing."""
    return [source_json(s) for s in summary.sources]


def summary_json(summary: Summary, ctx: RequestContext) -> dict[str, Any]:
    return {
        "request_id": summary.request_id, "output": summary.output_text, "finish_reason": summary.finish_reason,
        "usage": {"input_tokens": summary.usage.input_tokens, "output_tokens": summary.usage.output_tokens},
        "cost_usd": summary.cost_usd, "trace_id": summary.trace_id,
        "duration_ms": round(summary.duration_s * 1e3, 3),
        "ttft_ms": None if summary.ttft_s is None else round(summary.ttft_s * 1e3, 3),
        "stages": [stage_json(s) for s in summary.stages], "sources": sources_json(summary),
        "pipeline_version": summary.pipeline_version, "spec_sha256": summary.spec_sha256,
        **answered_by(ctx), **_choices_json(summary),
        **({"pending_approval": pending} if (pending := approvals.pending_requests(ctx)) is not None else {}),
    }


def _choices_json(summary: Summary) -> dict[str, Any]:
    """A pipeline that samples ``n`` above 1: every answer (``output`` is choice 0's); nothing otherwise."""
    if not summary.choices:
        return {}
    return {"choices": [{"index": c.index, "output": c.text, "finish_reason": c.finish_reason,
                         "output_tokens": c.output_tokens} for c in summary.choices]}


def answered_by(ctx: RequestContext) -> dict[str, Any]:
    """The model that answered, and the models tried before it (a route's fallbacks), if any."""
    tried = ctx.facts.get("route", {}).get("fallbacks_tried", [])
    return {"model": ctx.model or None, "fallbacks_tried": [t["model"] for t in tried]}


async def start_request(services: Services, request: Request, name: str, messages: list[ChatMessage],
                        params: dict[str, Any], tags: dict[str, str] | None = None,
                        stop: list[str] | None = None, operation: str = "chat") -> tuple[Pipeline, RequestContext]:
    """Authorize the caller for pipeline *name* and build its request context. ``name@version`` (the
    OpenAI API's ``model``) or an ``X-Pipeline-Version`` header pins a kept version of it."""
    name, _, pin = name.partition("@")
    pin = pin or request.headers.get(PIN_HEADER, "")
    pipeline = await services.pinned(name, pin) if pin else services.executor.get(name)
    attempt = attempt_of(request)  # what the server's record of a refusal names (serving/http/refusals.py)
    attempt.pipeline = pipeline
    attempt.principal = principal = await services.auth.principal(request)
    sticky = principal.key_id if principal else (request.client.host if request.client else "")
    # A canary: each caller key sticks to a version.
    if not pin and (split := services.deployments.split_choice(name, sticky)):
        attempt.pipeline = pipeline = await services.pinned(name, split)
    services.auth.require(principal, pipeline.spec.access.roles, f"call pipeline {name!r}")
    if (operation == "embeddings") != pipeline.embeds:
        if operation == "embeddings":
            others = sorted(name for name, p in services.executor.pipelines.items() if p.embeds)
            raise bad_request(f"model: pipeline {pipeline.name!r} makes no embeddings (it has no embed stage); "
                              f"embeddings pipelines: {', '.join(others) or 'none'}", "model")
        raise bad_request(f"model: pipeline {pipeline.name!r} makes embeddings, not text: call POST /v1/embeddings",
                          "model")
    if services.audit.mode == "required" and not services.audit.is_durable():
        raise Problem(503, "Backend unavailable", "audit records cannot be made durable right now "
                      "(audit.mode: required); retry shortly", "audit_unavailable", {"Retry-After": "5"})
    ctx = RequestContext(pipeline=name, input_messages=messages, principal=principal, tags=dict(tags or {}),
                         params=params, stop=list(stop or []), operation=operation,
                         client_addr=request.client.host if request.client else "")
    attempt.ctx = ctx
    return pipeline, ctx



@post("/pipelines/{name:str}", summary="Run a pipeline", status_code=200, operation_class=JsonOrEventStream,
      responses=problems(400, 401, 403, 404, 413, 422, 429, 503, 504), opt={RUNS_PIPELINE: "name"},
      description="JSON answer, or Server-Sent Events with `\"stream\": true` or `Accept: text/event-stream`.")
async def run_pipeline(name: FromPath[str], data: JSONBody[PipelineRequest], request: Request,
                       services: NamedDependency[Services]) -> Response[Any]:
    pipeline, ctx = await start_request(services, request, name, [] if data.resume else data.chat(),
                                        data.overrides(), data.tags)
    if data.resume is not None:
        ctx.input_messages = await approvals.resume(services, pipeline, ctx, data.resume,
                                                    {a.id: a.approve for a in data.approvals or []}, "resume")
    approvals.offer(services, ctx)
    if data.stream or "text/event-stream" in request.headers.get("accept", ""):
        events = services.executor.stream(pipeline, ctx)
        head = await head_of_stream(events, pipeline)
        if isinstance(head[-1], Error):  # ended before any text: an HTTP error status, not a 200 stream
            raise failure(head[-1], ctx)
        return event_stream(_sse(head, events, ctx), response_headers(ctx))
    final = await answered(services.executor, pipeline, ctx)
    return Response(summary_json(final.summary, ctx), headers=response_headers(ctx))


#: The request header that pins a version (its ``version:`` label or spec hash prefix); answers carry it too.
PIN_HEADER = "x-pipeline-version"


def response_headers(ctx: RequestContext) -> dict[str, str]:
    """The request id, the pipeline version that serves it, the model that answers (when one was handed
    the request), and what the policy stage counted (rate-limit and budget headers)."""
    return {"X-Request-Id": ctx.request_id, "X-Pipeline-Version": ctx.pipeline_version,
            "X-Pipeline-Spec-Sha256": ctx.spec_sha256, **({"X-Inferline-Model": ctx.model} if ctx.model else {}),
            **limit_headers(ctx.facts.get("limits"))}


async def answered(executor: Executor, pipeline: Pipeline, ctx: RequestContext) -> Done:
    """The request run to its end; the HTTP error status its failure or refusal means, raised."""
    final = await executor.run(pipeline, ctx)
    if isinstance(final, Error):
        raise failure(final, ctx)
    return final


async def started(executor: Executor, pipeline: Pipeline, ctx: RequestContext) -> AsyncIterator[Event]:
    """The request's events, once its first text (or its end) has come: a request refused or failed
    before any text raises its HTTP error status rather than starting a 200 stream."""
    events = executor.stream(pipeline, ctx)
    head = await head_of_stream(events, pipeline)
    if isinstance(head[-1], Error):
        raise failure(head[-1], ctx)
    return with_head(head, events)


def failure(final: Error, ctx: RequestContext) -> Problem:
    problem = from_final(final.kind, final.message, ctx.error)
    problem.headers = {**problem.headers, **response_headers(ctx)}
    problem.extra = {**problem.extra, "request_id": ctx.request_id, "trace_id": ctx.trace_id,
                     "stages": [stage_json(s) for s in final.summary.stages]}
    return problem


async def _sse(head: list[Event], events: AsyncIterator[Event], ctx: RequestContext) -> AsyncIterator[bytes]:
    """*head* (what :func:`head_of_stream` read) as one chunk, then each later event as it comes. One chunk is
    one write to the socket: the head's six or so stage events in one chunk save a write each, on the event
    loop, right after a burst's first prefill step, when every request of the burst needs the loop."""
    # A client disconnect stops this generator; closing ``events`` cancels the request.
    try:
        yield b"".join(_message(event, ctx) for event in head)
        if not isinstance(head[-1], (Done, Error)):
            async for event in events:
                yield _message(event, ctx)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _message(event: Event, ctx: RequestContext) -> bytes:
    if isinstance(event, TextDelta):
        request = ctx.facts.get("generate_request")  # generate sampled n above 1: say whose text it is
        several = request is not None and request[0].n > 1
        return sse_event("delta", {"text": event.text, **({"index": event.index} if several else {})})
    if isinstance(event, (StageStarted, StageFinished)):
        return sse_event("stage", stage_event(event))
    if isinstance(event, Done):
        return sse_event("done", summary_json(event.summary, ctx))
    problem = from_final(event.kind, event.message, None)
    payload = {**problem.body(), "request_id": event.summary.request_id, "trace_id": event.summary.trace_id}
    return sse_event("error", payload)


@get("/pipelines", summary="List the served pipelines", responses=problems(401, 403, 503))
async def list_pipelines(request: Request, auth: NamedDependency[Authenticator], executor: NamedDependency[Executor],
                         reloader: NamedDependency[PipelineReloader]) -> dict[str, Any]:
    await auth.authorize(request, ("caller", "auditor"), "list pipelines")
    return {"pipelines": [describe(p, executor.metrics.slo_report(name), _reload_error(reloader, name))
                          for name, p in executor.pipelines.items()],
            "reload_errors": [error.to_json() for error in reloader.errors.values()]}


@get("/pipelines/{name:str}", summary="Describe one pipeline", responses=problems(400, 401, 403, 404, 503))
async def get_pipeline(name: FromPath[str], request: Request, auth: NamedDependency[Authenticator],
                       executor: NamedDependency[Executor], reloader: NamedDependency[PipelineReloader]
                       ) -> dict[str, Any]:
    await auth.authorize(request, ("caller", "auditor"), "describe pipelines")
    return describe(executor.get(name), executor.metrics.slo_report(name), _reload_error(reloader, name))


def _reload_error(reloader: PipelineReloader, name: str) -> dict[str, Any] | None:
    error = reloader.error_for(name)
    return None if error is None else error.to_json()


def describe(pipeline: Pipeline, slo: dict[str, Any] | None = None,
             reload_error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline's spec as served; *slo*: its objectives with their attainment (serving/runtime/slo.py);
    *reload_error*: its file's last edit, which failed to load (the version described keeps serving)."""
    spec = pipeline.spec
    return {
        "name": spec.name, "description": spec.description, "version": spec.version,
        "sha256": pipeline.loaded.sha256, "access": {"roles": spec.access.roles},
        "stages": [{"id": s.id, "type": s.type, "with": s.with_, "when": s.when, "always": s.always,
                    "on_error": s.on_error, "timeout_s": s.timeout_s} for s in spec.stages],
        "endpoint": f"/pipelines/{spec.name}", "input_schema": PipelineRequest.model_json_schema(),
        "slo": slo, "reload_error": reload_error,
    }


def problem_response(problem: Problem, instance: str) -> Response[Any]:
    return Response(problem.body(instance), status_code=problem.status, headers=problem.headers,
                    media_type="application/problem+json")


ROUTES = [run_pipeline, list_pipelines, get_pipeline]
