"""Requests from one pipeline to another in the same process: the judges of ``score`` stages and evals, and
the sub-pipelines of ``pipeline`` steps. Whether the pipelines they name are served is checked when the files
load (serving/runtime/pipeline_set.py)."""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from pipeline.context import RequestContext
from pipeline.errors import BackendError, PolicyDenied
from pipeline.events import Done, Error, Event, StageFinished, StageStarted, TextDelta
from pipeline.protocols import PipelineResult
from pipeline.runner import Pipeline
from serving.runtime.pipeline_tool import input_schema
from store.pipeline_versions import version_matches

#: How deep calls may nest: a judge may not call a judge (nor a pipeline itself, through its score stage).
MAX_DEPTH = 1
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("inferline_pipeline_call_depth", default=0)
#: How deep sub-pipelines may nest (calls to themselves do not load; a pin to another version could still loop).
MAX_NESTED = 8
_NESTED: contextvars.ContextVar[int] = contextvars.ContextVar("inferline_sub_pipeline_depth", default=0)


class Requests(Protocol):
    """What runs one request of a pipeline to its end: a bare :class:`~pipeline.runner.Runner`, or the app's
    executor, which counts it in the app's metrics."""

    async def run(self, pipeline: Pipeline, ctx: RequestContext) -> Done | Error: ...


class LocalPipelines:
    """The :class:`~pipeline.protocols.PipelineCaller` over this process's pipelines.

    *run* executes one request (the server's executor, so judge requests are counted in its
    metrics like any other, or a bare runner); each call is a new request of its own, with its
    own trace and, if the called pipeline has an audit stage, its own audit record.
    """

    def __init__(self, pipelines: Mapping[str, Pipeline],
                 run: Callable[[Pipeline, RequestContext], Awaitable[Done | Error]],
                 stream: Callable[[Pipeline, RequestContext], AsyncIterator[Event]] | None = None,
                 pinned: Callable[[str, str], Awaitable[Pipeline | None]] | None = None):
        self.pipelines = pipelines
        #: Executes one request: a bare runner's, or the server's executor (so that it counts them).
        self.run = run
        #: A sub-pipeline's events (the runner's: a part of its caller's request, not a request of its own).
        self.stream = stream
        #: A kept version of a pipeline (``name@version``), when this process keeps versions.
        self.pinned = pinned

    async def call_nested(self, pipeline: str, version: str | None, ctx: RequestContext,
                          on_text: Callable[[str], Awaitable[None]] | None = None,
                          on_step: Callable[[StageStarted | StageFinished], None] | None = None) -> Done | Error:
        """A ``pipeline`` step's callee, run as a part of its caller's request (PipelineCaller.call_nested)."""
        target = await self._callee(pipeline, version)
        roles = target.spec.access.roles
        role = ctx.principal.role if ctx.principal is not None else None
        if role is not None and role != "admin" and role not in roles:  # None: auth is off
            raise PolicyDenied(f"pipeline {pipeline!r} does not let the caller's role {role!r} call it (its roles: "
                               f"{', '.join(roles)})", rule="access.roles", category="auth")
        depth = _NESTED.get()
        if depth >= MAX_NESTED:
            raise BackendError(f"pipeline {pipeline!r}: sub-pipelines nest {MAX_NESTED} deep at most")
        if self.stream is None:
            raise BackendError("this process runs no sub-pipelines")
        token = _NESTED.set(depth + 1)
        final: Done | Error | None = None
        try:
            async for event in self.stream(target, ctx):
                if isinstance(event, TextDelta) and on_text is not None:
                    await on_text(event.text)
                elif isinstance(event, (StageStarted, StageFinished)) and on_step is not None:
                    on_step(event)
                elif isinstance(event, (Done, Error)):
                    final = event
        finally:
            _NESTED.reset(token)
        if final is None:
            raise BackendError(f"pipeline {pipeline!r} ended without an answer")
        return final

    async def tool_schema(self, pipeline: str, version: str | None) -> dict[str, Any]:
        """*pipeline*'s arguments as a tool (PipelineCaller.tool_schema)."""
        try:
            return input_schema(await self._callee(pipeline, version))
        except SQLAlchemyError as exc:  # a kept version (NAME@VERSION) is read from the database
            raise BackendError(f"pipeline {pipeline!r}@{version}: its versions cannot be read ({type(exc).__name__})"
                               ) from None

    async def _callee(self, pipeline: str, version: str | None) -> Pipeline:
        served = self.pipelines.get(pipeline)
        if served is None:
            raise BackendError(f"no pipeline {pipeline!r} is served here (pipelines: "
                               f"{', '.join(sorted(self.pipelines)) or 'none'})")
        if version is None or version_matches(served.spec.version, served.loaded.sha256, version):
            return served
        kept = await self.pinned(pipeline, version) if self.pinned is not None else None
        if kept is None:
            raise BackendError(f"pipeline {pipeline!r} has no version {version!r} here (serving: version "
                               f"{served.spec.version}, {served.loaded.sha256[:12]})")
        return kept

    async def call(self, pipeline: str, input: str, tags: Mapping[str, str]) -> PipelineResult:
        target = self.pipelines.get(pipeline)
        if target is None:
            served = ", ".join(sorted(self.pipelines)) or "none"
            return PipelineResult("failed", "", 0.0, "", f"no pipeline {pipeline!r} here (pipelines: {served})")
        depth = _DEPTH.get()
        if depth >= MAX_DEPTH:
            return PipelineResult("failed", "", 0.0, "", f"pipeline {pipeline!r} was called from a pipeline that "
                                  "was itself called by another: calls nest one level only")
        ctx = RequestContext.from_text(pipeline, input, tags=dict(tags))
        token = _DEPTH.set(depth + 1)  # the runner's task copies this context: nested calls see it
        try:
            final = await self.run(target, ctx)
        finally:
            _DEPTH.reset(token)
        summary = final.summary
        if isinstance(final, Error):
            return PipelineResult(final.status, summary.output_text, summary.cost_usd, summary.request_id,
                                  final.message)
        return PipelineResult("ok", summary.output_text, summary.cost_usd, summary.request_id)
