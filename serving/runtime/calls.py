"""Requests from one pipeline to another in the same process: the judges of ``score`` stages and evals."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path

from pipeline.context import RequestContext
from pipeline.diagnostics import suggest
from pipeline.errors import SpecError, SpecIssue
from pipeline.events import Done, Error
from pipeline.loader import LoadedPipeline
from pipeline.protocols import PipelineResult
from pipeline.runner import Pipeline
from pipeline.yamlsrc import format_loc, parse

#: How deep calls may nest: a judge may not call a judge (nor a pipeline itself, through its score stage).
MAX_DEPTH = 1
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("inferline_pipeline_call_depth", default=0)


class LocalPipelines:
    """The :class:`~pipeline.protocols.PipelineCaller` over this process's pipelines.

    *run* executes one request (the server's executor, so judge requests are counted in its
    metrics like any other, or a bare runner); each call is a new request of its own, with its
    own trace and, if the called pipeline has an audit stage, its own audit record.
    """

    def __init__(self, pipelines: Mapping[str, Pipeline],
                 run: Callable[[Pipeline, RequestContext], Awaitable[Done | Error]]):
        self.pipelines = pipelines
        #: Executes one request: a bare runner's, or the server's executor (so that it counts them).
        self.run = run

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


def check_calls(loaded: Sequence[LoadedPipeline], available: Collection[str] | None = None) -> None:
    """Every judge a ``score`` stage names is among *available* (default: the *loaded* pipelines) and is not
    the pipeline itself; raises :class:`SpecError` with each problem located in its file."""
    names = set(available if available is not None else (p.spec.name for p in loaded))
    issues: list[SpecIssue] = []
    for item in loaded:
        for index, plan in enumerate(item.plans):
            for number, check in enumerate(getattr(plan.config, "checks", ()) if plan.spec.type == "score" else ()):
                target = getattr(check, "pipeline", None)
                if target is None or (target in names and target != item.spec.name):
                    continue
                why = ("a pipeline cannot judge itself" if target == item.spec.name else
                       f"no pipeline {target!r} is served beside it{suggest(target, sorted(names))} "
                       f"(pipelines: {', '.join(sorted(names))})")
                issues.append(_locate(item.file, ("stages", index, "with", "checks", number, "pipeline"), why))
    if issues:
        raise SpecError(issues)


def _locate(file: str, loc: tuple[str | int, ...], message: str) -> SpecIssue:
    try:
        src, _ = parse(file, Path(file).read_text(encoding="utf-8"))
    except OSError:
        src = None
    if src is None:
        return SpecIssue(file, 1, 1, format_loc(loc), message)
    return src.issue(loc, message)
