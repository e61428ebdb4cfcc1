"""``inferline run``: one request through one pipeline, in-process, as ``POST /pipelines/{name}`` takes it.

    inferline run support-answer --input "How do I reset my password?" --trace
    inferline run routed --input "Hello!" --tag tier=gold --param max_tokens=32 --param temperature=0
    inferline run chat --message "system:Answer in French." --message "user:Hello!"

The request is the HTTP API's (serving/http/pipeline_routes.py ``PipelineRequest``) and is validated by it:
``--input`` or ``--message`` for ``input`` or ``messages``, ``--tag`` for ``tags``, ``--param`` for the
sampling parameters. The models the pipeline uses are started before the request, so that ``--trace``
shows their loading as rows of its own and the stages' times and TTFT without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from pydantic import ValidationError

from pipeline.context import RequestContext, StageRecord
from pipeline.events import Done, Error, StageFinished, Summary, TextDelta
from pipeline.loader import LoadedPipeline
from pipeline.refs import find_refs
from pipeline.runner import Pipeline
from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subcommands, config_option
from serving.http.schemas import GenerationParams, PipelineRequest
from serving.runtime.workspace import Workspace, open_workspace

#: Request parameters ``--param`` may set: the HTTP API's sampling fields.
PARAMS = tuple(GenerationParams.model_fields)
#: Context fields that only a model's stage reads or writes: a pipeline with such a stage uses a model.
_MODEL_FIELDS = frozenset({"model", "prompt_ids", "token_stream"})


class UsageError(Exception):
    """A request option that the HTTP API would refuse with 400."""


def add_run_parser(subparsers: Subcommands) -> None:
    run = subparsers.add_parser(
        "run", help="run one request through a pipeline, in-process",
        description="Run one request through PIPELINE and stream its text to stdout. PIPELINE is a YAML file, or "
                    "a pipeline of the pipelines folder by its name: (as `serve` exposes it, /pipelines/NAME) or "
                    "its file name. The request is what POST /pipelines/NAME takes, and is checked the same way. "
                    "The models the pipeline uses start before the request.")
    run.add_argument("pipeline", metavar="PIPELINE")
    given = run.add_mutually_exclusive_group(required=True)
    given.add_argument("--input", "-i", metavar="TEXT", help="the user's message (the request's input)")
    given.add_argument("--message", "-m", action="append", metavar="ROLE:TEXT",
                       help="one turn of a conversation (the request's messages), in order; ROLE is system, user "
                            "or assistant, and one turn at least is the user's. Repeat it: --message "
                            "'system:Be brief.' --message 'user:Hello!'")
    run.add_argument("--tag", "-t", action="append", metavar="KEY=VALUE",
                     help="a request tag (tags: in the HTTP API), seen by when: conditions, route rules and the "
                          "audit log, e.g. --tag tier=gold; repeatable")
    run.add_argument("--param", "-p", action="append", metavar="NAME=VALUE",
                     help=f"a request parameter, one of {', '.join(PARAMS)}; VALUE is JSON (a number, an "
                          "object for output) or else text, checked as the HTTP API checks it. The pipeline's "
                          "generate stage takes those its client_params list. Repeatable")
    run.add_argument("--trace", action="store_true",
                     help="print to stderr a row per model started for the request (type load), then each "
                          "stage's status, start, duration and cost, and the total, TTFT (neither counts the "
                          "loading) and trace id")
    config_option(run)
    run.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    try:
        request = request_of(args.input, args.message or (), args.tag or (), args.param or ())
    except UsageError as exc:
        print(f"inferline run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    workspace = open_workspace(args.config)
    loaded = workspace.load_pipeline(workspace.resolve(args.pipeline))
    return asyncio.run(_run_once(workspace, loaded, request, args.trace))


def request_of(text: str | None, messages: Sequence[str], tags: Sequence[str],
               params: Sequence[str]) -> PipelineRequest:
    """The HTTP API's request for these options; raises UsageError with what it refuses, by option."""
    data: dict[str, Any] = {"tags": _pairs("--tag", tags)}
    if messages:
        data["messages"] = [_turn(raw) for raw in messages]
    else:
        data["input"] = text
    values = _pairs("--param", params)
    unknown = [name for name in values if name not in PARAMS]
    if unknown:
        raise UsageError(f"--param {unknown[0]}: unknown parameter; known: {', '.join(PARAMS)}")
    data.update({name: _json_or_text(raw) for name, raw in values.items()})
    try:
        return PipelineRequest.model_validate(data)
    except ValidationError as exc:
        raise UsageError("; ".join(_refusal(error) for error in exc.errors())) from None


def _pairs(option: str, items: Sequence[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{option} {item!r}: expected KEY=VALUE, e.g. {option} "
                             + ("tier=gold" if option == "--tag" else "max_tokens=64"))
        if key.strip() in pairs:
            raise UsageError(f"{option} {key.strip()}: given twice")
        pairs[key.strip()] = value
    return pairs


def _turn(raw: str) -> dict[str, str]:
    role, sep, content = raw.partition(":")
    if not sep:
        raise UsageError(f"--message {raw!r}: expected ROLE:TEXT, e.g. --message 'user:Hello!'")
    return {"role": role.strip().lower(), "content": content}


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _refusal(error: Any) -> str:
    loc = error["loc"]
    message = error["msg"].removeprefix("Value error, ")
    if not loc:
        return message
    if loc[0] == "messages":
        where = f"--message {loc[1] + 1}" if len(loc) > 1 else "--message"
        return f"{where}: {' '.join(map(str, loc[2:]))}: {message}" if len(loc) > 2 else f"{where}: {message}"
    if loc[0] in ("input", "tags"):
        return f"--{loc[0].removesuffix('s')}: {message}"
    return f"--param {'.'.join(map(str, loc))}: {message}"


def models_used(loaded: Sequence[LoadedPipeline], default_model: str) -> list[str]:
    """The models *loaded* may call: those their stages name, and the default one when a stage uses a
    model without a route naming its default."""
    names: list[str] = []
    uses_default = False
    for item in loaded:
        routed = False
        for plan in item.plans:
            refs = [(loc, name) for loc, kind, name in find_refs(plan.config) if kind == "model"]
            names += [name for _, name in refs]
            routed |= "model" in plan.cls.writes and any(loc == ("default",) for loc, _ in refs)
            uses_default |= not routed and bool(_MODEL_FIELDS & (plan.cls.reads | plan.cls.writes))
    if uses_default and default_model:
        names.insert(0, default_model)
    return list(dict.fromkeys(names))


async def _run_once(workspace: Workspace, loaded: LoadedPipeline, request: PipelineRequest, show_trace: bool) -> int:
    from serving.cli.eval import score_judges
    from serving.runtime.resources import Runtime

    streamed = False
    final: Done | Error | None = None
    judges = score_judges(workspace, loaded)
    async with Runtime(workspace, [loaded, *judges]) as runtime:
        loads = []
        for name in models_used([loaded, *judges], runtime.engines.default_model):
            started = time.perf_counter()
            await runtime.engines.get(name)
            loads.append((name, time.perf_counter() - started))
        ctx = RequestContext(pipeline=loaded.spec.name, input_messages=request.chat(), tags=dict(request.tags),
                             params=request.overrides())
        pipeline: Pipeline = runtime.pipelines[loaded.spec.name]
        async for event in runtime.runner.stream(pipeline, ctx):
            if isinstance(event, TextDelta):
                streamed = True
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, (Done, Error)):
                final = event
            elif isinstance(event, StageFinished) and event.status in ("failed", "timeout"):
                print(f"stage {event.stage_id} {event.status}: {event.error}", file=sys.stderr)
    if streamed:
        sys.stdout.write("\n")
        sys.stdout.flush()
    elif isinstance(final, Done):
        _print_messages(ctx, sys.stdout)
    if final is not None and show_trace:
        print_trace(final.summary, loads, sys.stderr)
    if isinstance(final, Error):
        print(f"inferline: request {final.status} ({final.kind}): {final.message}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _print_messages(ctx: RequestContext, out: TextIO) -> None:
    # A pipeline without a streaming stage (prompt only, say) has no text for
    # the client; show what it built instead of printing nothing.
    print("(no stage streamed text; the messages the pipeline built:)", file=sys.stderr)
    for message in ctx.messages:
        print(f"[{message.role}] {message.content}", file=out)


def _name(stage: StageRecord) -> str:
    """The step's id, indented under the step a sub-pipeline ran in, with its item's index (for_each)."""
    depth = stage.parent.count("/") + 1 if stage.parent else 0
    return "  " * depth + stage.id + (f"[{stage.item}]" if stage.item is not None else "")


def _status(stage: StageRecord) -> str:
    """``ok``, ``skipped (when)``, ``failed #1`` (an attempt that was retried), ``ok (for gen)`` (a fallback),
    ``ok (round 2)`` (a loop's)."""
    notes = [stage.skip_reason] if stage.skip_reason else []
    notes += [f"round {stage.round}"] if stage.round > 1 else []
    notes += [f"for {stage.fallback_for}"] if stage.fallback_for else []
    attempt = f" #{stage.attempt}" if stage.attempt > 1 or stage.status not in ("ok", "skipped") else ""
    return f"{stage.status}{attempt}" + (f" ({', '.join(notes)})" if notes else "")


def print_trace(summary: Summary, loads: Sequence[tuple[str, float]], out: TextIO) -> None:
    """The steps of *summary* (each attempt; a sub-pipeline's indented under its step), after a ``load`` row per
    model started before the request (its start: -); steps that ran side by side overlap in their start and ms."""
    rows = [("stage", "type", "status", "start ms", "ms", "tokens", "cost usd")]
    rows += [(name, "load", "ok", "-", f"{seconds * 1e3:.2f}", "-", "-") for name, seconds in loads]
    rows += [(_name(s), s.type, _status(s),
              f"{s.started_s * 1e3:.2f}", f"{s.duration_s * 1e3:.2f}",
              f"{s.input_tokens}/{s.output_tokens}" if s.input_tokens or s.output_tokens else "-", f"{s.cost_usd:.6f}")
             for s in summary.stages]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out)
    ttft = "-" if summary.ttft_s is None else f"{summary.ttft_s * 1e3:.2f} ms"
    loading = f" (model loading before it: {sum(s for _, s in loads) * 1e3:.2f} ms)" if loads else ""
    print(f"total {summary.duration_s * 1e3:.2f} ms, ttft {ttft}{loading}, cost {summary.cost_usd:.6f} usd, "
          f"trace {summary.trace_id}", file=out)
