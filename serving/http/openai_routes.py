"""The OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

``model`` names a pipeline. Streaming sends ``chat.completion.chunk`` objects
(``text_completion`` for completions) and ``data: [DONE]``; with
``stream_options: {include_usage: true}`` a last chunk carries the usage.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
so the official ``openai`` package raises its usual exceptions.

Structured output and function calling (both need ``output`` in the pipeline's ``generate``
``client_params``, as by default; and, where that stage has an ``output`` of its own, its
``caller_may_override: true``, else the request is refused with a 400 that says so):
``response_format`` ``json_object`` or ``json_schema`` constrains the reply to JSON (to that schema).
``tools`` are offered to the model (see :mod:`stages.tools`); with ``tool_choice`` ``required`` or a
named function the reply is constrained to a valid call, with ``auto`` (the default) a reply that is a
call of an offered function becomes one. A call answers ``message.tool_calls`` with
``finish_reason: "tool_calls"``; streamed, the reply is held back while it may still be a call. A
forced call cut short by ``max_tokens`` answers ``finish_reason: "length"`` with neither
``tool_calls`` nor content. Earlier calls and ``tool`` results in ``messages`` travel as text.

Extension: every response (streamed, the chunk with the ``finish_reason``) carries ``sources``, the
retrieved documents the answer was given from and the ``[n]`` each is cited by, as in the pipeline
API (:func:`serving.http.pipeline_routes.source_json`); an empty list when nothing was retrieved.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, get, post
from litestar.params import JSONBody
from litestar.response import Response

from pipeline.context import ChatMessage, RequestContext
from pipeline.events import Done, Error, Event, TextDelta
from serving.http.openai_common import (
    chat_turns,
    check_choice,
    check_functions,
    error_body,
    refuse,
)
from serving.http.openapi import JsonOrEventStream, openai_errors
from serving.http.pipeline_routes import answered_by, failure, response_headers, sources_json, start_request
from serving.http.problems import bad_request, checked, from_final
from serving.http.schemas import (
    RESPONSE_FORMAT,
    TOOL_CHOICE,
    TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    OpenAIRequest,
)
from serving.http.served import encode_json, event_stream, head_of_stream, with_head
from serving.http.state import AppState
from serving.http.tool_replies import HeldReply, call_of, constrain_output, is_cut_call
from stages import tools


@post("/v1/chat/completions", summary="OpenAI-compatible chat completion", tags=["openai"], status_code=200,
      operation_class=JsonOrEventStream, responses=openai_errors(400, 401, 403, 404, 413, 422, 429, 503, 504))
async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request) -> Response[Any]:
    return await _complete(request, data, chat_turns(data.messages), "chat.completion")


@post("/v1/completions", summary="OpenAI-compatible text completion", tags=["openai"], status_code=200,
      operation_class=JsonOrEventStream, responses=openai_errors(400, 401, 403, 404, 413, 422, 429, 503, 504))
async def completions(data: JSONBody[CompletionRequest], request: Request) -> Response[Any]:
    return await _complete(request, data, [ChatMessage("user", data.prompt)], "text_completion")


@get("/v1/models", summary="The pipelines, as OpenAI models", tags=["openai"],
     responses=openai_errors(401, 403, 503))
async def list_models(request: Request) -> dict[str, Any]:
    state = AppState.of(request)
    await state.auth.authorize(request, ("caller", "auditor"), "list models")
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "inferline"}
                                       for name in sorted(state.executor.pipelines)]}


def _offer_tools(ctx: RequestContext, data: ChatCompletionRequest) -> None:
    """Set the request's tools, tool choice and the ``output`` constraint its options ask for."""
    response_format = checked(RESPONSE_FORMAT, data.response_format, "response_format")
    ctx.tools = check_functions([t.model_dump(exclude_none=True) for t in checked(TOOLS, data.tools, "tools") or []],
                                ".function.parameters")
    choice = checked(TOOL_CHOICE, data.tool_choice, "tool_choice",
                     """'auto', 'none', 'required' or {"type": "function", "function": {"name": ...}}""")
    ctx.tool_choice = check_choice(choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
                                   list(tools.functions(ctx.tools)))
    schema: dict[str, Any] | None = None
    if isinstance(response_format, JsonObjectFormat):
        schema = {"type": "object"}
    elif isinstance(response_format, JsonSchemaFormat):
        schema = response_format.json_schema.schema_
        problem = tools.strict_problem(schema) if response_format.json_schema.strict else None
        if problem is not None:
            raise bad_request(f"response_format.json_schema.schema: {problem}", "response_format")
    constrain_output(ctx, schema)


async def _complete(request: Request, data: OpenAIRequest, messages: list[ChatMessage], kind: str) -> Response[Any]:
    refuse(data.refused_fields())
    state = AppState.of(request)
    tags = {"user": data.user} if data.user else None
    pipeline, ctx = await start_request(state, request, data.model, messages, data.overrides(), tags,
                                        stop=data.stops(), operation="chat" if kind == "chat.completion"
                                        else "text_completion")
    if isinstance(data, ChatCompletionRequest):
        _offer_tools(ctx, data)
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        continuous = bool(data.stream_options and data.stream_options.continuous_usage_stats)
        events = state.executor.stream(pipeline, ctx)
        head = await head_of_stream(events)
        if isinstance(head[-1], Error):  # refused or failed before any text: an HTTP error status
            raise failure(head[-1], ctx)
        chunks = _chunks(with_head(head, events), ctx, data.model, kind, include_usage, continuous)
        return event_stream(chunks, response_headers(ctx))
    final = await state.executor.run(pipeline, ctx)
    if isinstance(final, Error):
        raise failure(final, ctx)
    return Response(_body(final, ctx, data.model, kind), headers=response_headers(ctx))


def _body(final: Done, ctx: RequestContext, model: str, kind: str) -> dict[str, Any]:
    summary = final.summary
    call = call_of(ctx, summary.output_text)
    if call is not None:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": None,
                                                          "tool_calls": [call.to_openai()]},
                                  "finish_reason": "tool_calls", "logprobs": None}
    elif is_cut_call(ctx, summary.finish_reason):
        choice = {"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "length",
                  "logprobs": None}
    elif kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": summary.output_text},
                  "finish_reason": _finish(summary.finish_reason), "logprobs": None}
    else:
        choice = {"index": 0, "text": summary.output_text, "finish_reason": _finish(summary.finish_reason),
                  "logprobs": None}
    return {**_envelope(ctx, model, kind), "choices": [choice], "usage": _usage(final),
            "sources": sources_json(summary), "system_fingerprint": summary.spec_sha256,
            "pipeline_version": summary.pipeline_version, "answered_by": answered_by(ctx)}


def _envelope(ctx: RequestContext, model: str, kind: str) -> dict[str, Any]:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{ctx.request_id}", "object": kind, "created": int(time.time()), "model": model}


def _usage(final: Done | Error) -> dict[str, int]:
    usage = final.summary.usage
    return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens}


def _finish(reason: str) -> str:
    return {"abort": "stop", "": "stop"}.get(reason, reason)


async def _chunks(events: AsyncIterator[Event], ctx: RequestContext, model: str, kind: str,
                  include_usage: bool, continuous: bool = False) -> AsyncIterator[bytes]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    envelope = _envelope(ctx, model, chunk_kind)

    def chunk(delta: dict[str, Any] | str, finish: str | None, extra: dict[str, Any] | None = None) -> bytes:
        choice = ({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                  if isinstance(delta, dict) else {"index": 0, "text": delta, "finish_reason": finish})
        body = {**envelope, "choices": [choice], **(extra or {})}
        if continuous:  # vLLM's continuous_usage_stats: the usage so far in every chunk
            usage = ctx.usage
            body["usage"] = {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
                             "total_tokens": usage.input_tokens + usage.output_tokens}
        elif include_usage:
            body["usage"] = None
        return _data(body)

    held = HeldReply(ctx) if chunk_kind.startswith("chat") and tools.is_offered(ctx.tools, ctx.tool_choice) else None
    try:
        if chunk_kind.startswith("chat") and held is None:
            yield chunk({"role": "assistant", "content": ""}, None)
        async for event in events:
            if isinstance(event, TextDelta) and held is not None:
                passing = held.passing
                if (content := held.feed(event.text)) is not None:
                    yield chunk({"content": content} if passing else {"role": "assistant", "content": content}, None)
            elif isinstance(event, TextDelta):
                yield chunk({"content": event.text} if chunk_kind.startswith("chat") else event.text, None)
            elif isinstance(event, Done):
                finish = _finish(event.summary.finish_reason)
                if held is not None:
                    deltas, finish = _held_end(held, finish)
                    for delta in deltas:
                        yield chunk(delta, None)
                empty: dict[str, Any] | str = {} if chunk_kind.startswith("chat") else ""
                yield chunk(empty, finish, {"sources": sources_json(event.summary)})
                if include_usage or continuous:
                    yield _data({**envelope, "choices": [], "usage": _usage(event)})
            elif isinstance(event, Error):
                yield _data(error_body(from_final(event.kind, event.message, ctx.error)))
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _held_end(held: HeldReply, finish: str) -> tuple[list[dict[str, Any]], str]:
    """The last deltas of a held reply, and the finish reason: the content held, or one call (id and name,
    then the arguments), or, for a forced call cut short, no content."""
    passing = held.passing
    reply = held.end(finish)
    if isinstance(reply, tools.ToolCall):
        head = {"index": 0, "id": reply.id, "type": "function", "function": {"name": reply.name, "arguments": ""}}
        return [{"role": "assistant", "content": None, "tool_calls": [head]},
                {"tool_calls": [{"index": 0, "function": {"arguments": reply.arguments}}]}], "tool_calls"
    if reply is not None:
        return [{"role": "assistant", "content": reply}], finish
    return ([] if passing else [{"role": "assistant", "content": None}]), finish


def _data(body: dict[str, Any]) -> bytes:
    """One chunk of a stream, as OpenAI sends it: compact JSON on one line."""
    return b"data: " + encode_json(body) + b"\n\n"


ROUTES = [chat_completions, completions, list_models]
