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
``{"type": "mcp"}`` tools are run by the server instead (:mod:`serving.http.openai_mcp`; here with
``require_approval: "never"`` only).

Extension: every response (streamed, the chunk with the ``finish_reason``) carries ``sources``, the
retrieved documents the answer was given from and the ``[n]`` each is cited by, as in the pipeline
API (:func:`serving.http.pipeline_routes.source_json`); an empty list when nothing was retrieved.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import Response

from pipeline.context import ChatMessage, RequestContext, TokenLogprob
from pipeline.events import Done, Error, Event, TextDelta
from serving.http import openai_mcp
from serving.http.auth import Authenticator
from serving.http.openai_common import (
    chat_turns,
    check_choice,
    check_functions,
    error_body,
    refuse,
)
from serving.http.openapi import JsonOrEventStream, openai_errors
from serving.http.pipeline_routes import (
    answered,
    answered_by,
    response_headers,
    sources_json,
    start_request,
    started,
)
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
from serving.http.served import Executor, encode_json, event_stream
from serving.http.services import Services
from serving.http.tool_replies import HeldReply, call_of, constrain_output, is_cut_call
from stages import tools


@post("/v1/chat/completions", summary="OpenAI-compatible chat completion", tags=["openai"], status_code=200,
      operation_class=JsonOrEventStream, responses=openai_errors(400, 401, 403, 404, 413, 422, 429, 503, 504))
async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request,
                           services: NamedDependency[Services]) -> Response[Any]:
    return await _complete(services, request, data, chat_turns(data.messages), "chat.completion")


@post("/v1/completions", summary="OpenAI-compatible text completion", tags=["openai"], status_code=200,
      operation_class=JsonOrEventStream, responses=openai_errors(400, 401, 403, 404, 413, 422, 429, 503, 504))
async def completions(data: JSONBody[CompletionRequest], request: Request,
                      services: NamedDependency[Services]) -> Response[Any]:
    return await _complete(services, request, data, [ChatMessage("user", data.prompt)], "text_completion")


@get("/v1/models", summary="The pipelines, as OpenAI models", tags=["openai"],
     responses=openai_errors(401, 403, 503))
async def list_models(request: Request, auth: NamedDependency[Authenticator],
                      executor: NamedDependency[Executor]) -> dict[str, Any]:
    await auth.authorize(request, ("caller", "auditor"), "list models")
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "inferline"}
                                       for name in sorted(executor.pipelines)]}


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


async def _complete(services: Services, request: Request, data: OpenAIRequest, messages: list[ChatMessage],
                    kind: str) -> Response[Any]:
    refuse(data.refused_fields())
    if isinstance(data, ChatCompletionRequest) and data.top_logprobs is not None and not data.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    if isinstance(data, ChatCompletionRequest) and data.logprobs and data.tools:
        raise bad_request("logprobs: a reply that may be a tool call is held back and reshaped, so its tokens' "
                           "log-probabilities are not returned here; send logprobs with no tools", "logprobs")
    if data.n > 1 and isinstance(data, ChatCompletionRequest) and data.tools:
        raise bad_request(f"n: tools are offered one answer at a time here; send n: 1 with tools (this request "
                           f"asked for {data.n})", "n")
    tags = {"user": data.user} if data.user else None
    mcp: list[dict[str, Any]] = []
    if isinstance(data, ChatCompletionRequest):
        data.tools, mcp = openai_mcp.split_tools(data.tools, services.runtime.resources.catalog.mcp_servers, False)
    pipeline, ctx = await start_request(services, request, data.model, messages, data.overrides(), tags,
                                        stop=data.stops(), operation="chat" if kind == "chat.completion"
                                        else "text_completion")
    if mcp:
        pipeline = openai_mcp.agent_pipeline(services, pipeline, mcp)
    if isinstance(data, ChatCompletionRequest):
        _offer_tools(ctx, data)
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        continuous = bool(data.stream_options and data.stream_options.continuous_usage_stats)
        chunks = _chunks(await started(services.executor, pipeline, ctx), ctx, data.model, kind, include_usage,
                         continuous, data.n, data.num_logprobs() is not None)
        return event_stream(chunks, response_headers(ctx))
    final = await answered(services.executor, pipeline, ctx)
    return Response(_body(final, ctx, data.model, kind, data.num_logprobs() is not None), headers=response_headers(ctx))


def _body(final: Done, ctx: RequestContext, model: str, kind: str, logprobs: bool = False) -> dict[str, Any]:
    summary = final.summary
    if summary.choices:  # n above 1: tools were refused, each answer is content
        choices = [_content_choice(kind, c.index, c.text, c.finish_reason,
                                   _logprobs(kind, c.logprobs) if logprobs else None) for c in summary.choices]
    else:
        choices = [_only_choice(ctx, kind, summary.output_text, summary.finish_reason,
                                _logprobs(kind, summary.logprobs) if logprobs else None)]
    return {**_envelope(ctx, model, kind), "choices": choices, "usage": _usage(final),
            "sources": sources_json(summary), "system_fingerprint": summary.spec_sha256,
            "pipeline_version": summary.pipeline_version, "answered_by": answered_by(ctx)}


def _content_choice(kind: str, index: int, text: str, finish_reason: str,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if kind == "chat.completion":
        return {"index": index, "message": {"role": "assistant", "content": text},
                "finish_reason": _finish(finish_reason), "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": _finish(finish_reason), "logprobs": logprobs}


def _logprobs(kind: str, tokens: tuple[TokenLogprob, ...], text_offset: int = 0) -> dict[str, Any]:
    """Tokens' log-probabilities as OpenAI shapes them: chat's ``{"content": [...]}``, or the completions
    API's ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (offsets from *text_offset*)."""
    if kind.startswith("chat"):
        return {"content": [{**_token(t.token, t.logprob), "top_logprobs": [_token(*top) for top in t.top]}
                            for t in tokens]}
    offsets = list(itertools.accumulate((len(t.token) for t in tokens[:-1]), initial=text_offset))
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens], "text_offset": offsets if tokens else []}


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _only_choice(ctx: RequestContext, kind: str, text: str, finish_reason: str,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one answer of an ``n: 1`` request: a tool call, a forced call cut short, or content."""
    call = call_of(ctx, text)
    if call is not None:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": None,
                                                          "tool_calls": [call.to_openai()]},
                                  "finish_reason": "tool_calls", "logprobs": None}
    elif is_cut_call(ctx, finish_reason):
        choice = {"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "length",
                  "logprobs": None}
    else:
        choice = _content_choice(kind, 0, text, finish_reason, logprobs)
    return choice


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
                  include_usage: bool, continuous: bool = False, n: int = 1,
                  logprobs: bool = False) -> AsyncIterator[bytes]:
    """The stream's chunks; with *n* above 1 each chunk carries one answer's delta under its index, and each
    answer ends with a chunk of its own ``finish_reason``. With *logprobs*, a delta's chunk carries the
    log-probabilities of the tokens its text came from."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    envelope = _envelope(ctx, model, chunk_kind)
    offsets = [0] * n  # completions: each answer's text so far, where its next token starts

    def chunk(delta: dict[str, Any] | str, finish: str | None, extra: dict[str, Any] | None = None,
              index: int = 0, tokens: tuple[TokenLogprob, ...] = ()) -> bytes:
        shaped = _logprobs(chunk_kind, tokens, offsets[index]) if logprobs and tokens else None
        choice = ({"index": index, "delta": delta, "finish_reason": finish, "logprobs": shaped}
                  if isinstance(delta, dict) else
                  {"index": index, "text": delta, "finish_reason": finish, "logprobs": shaped})
        offsets[index] += sum(len(t.token) for t in tokens)
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
            for index in range(n):
                yield chunk({"role": "assistant", "content": ""}, None, index=index)
        async for event in events:
            if isinstance(event, TextDelta) and held is not None:
                passing = held.passing
                if (content := held.feed(event.text)) is not None:
                    yield chunk({"content": content} if passing else {"role": "assistant", "content": content}, None)
            elif isinstance(event, TextDelta):
                yield chunk({"content": event.text} if chunk_kind.startswith("chat") else event.text, None,
                            index=event.index, tokens=event.logprobs)
            elif isinstance(event, Done):
                finish = _finish(event.summary.finish_reason)
                if held is not None:
                    deltas, finish = _held_end(held, finish)
                    for delta in deltas:
                        yield chunk(delta, None)
                empty: dict[str, Any] | str = {} if chunk_kind.startswith("chat") else ""
                ends = [(c.index, _finish(c.finish_reason)) for c in event.summary.choices] or [(0, finish)]
                for index, reason in ends:
                    yield chunk(empty, reason, {"sources": sources_json(event.summary)}, index)
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
