"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Clients built on the official ``anthropic`` package work unchanged with ``base_url`` at the server
(the key as ``x-api-key``, which :mod:`serving.http.auth` takes as it takes a bearer key). ``model``
names a pipeline, which runs as on every other route (:func:`start_request`: roles, policy, limits,
budgets, audit). The request's turns, tools and tool choice are read by
:mod:`serving.http.anthropic_schemas`; a forced tool call (``tool_choice`` ``any`` or ``tool``) is
decoded under the constraint that only a valid call matches (:mod:`serving.http.tool_replies`).

The answer is a ``message`` with one ``text`` block, or one ``tool_use`` block
(``stop_reason: "tool_use"``); ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence``
(one of the request's ``stop_sequences`` ended it: ``stop_sequence`` names it), ``tool_use``, or
``refusal`` (a policy's output rail stopped it). A forced call cut short by ``max_tokens`` has no
content. Streamed: ``message_start``, ``ping``, then the block (``content_block_start``,
``content_block_delta``\\s of ``text_delta`` or one ``input_json_delta``, ``content_block_stop``),
``message_delta`` (the stop reason and usage) and ``message_stop``; an error once the stream has
started is an ``error`` event. While tools are offered the reply is held back until it cannot be a
call any more.

``count_tokens`` answers ``{"input_tokens": N}``: the messages the pipeline's ``prompt`` stage builds
from the request (its system and user templates; nothing retrieved yet), with the tools, through the
chat template of the pipeline's ``tokenize`` model (else the server's first), before any trimming to
``max_input_tokens``. For a pipeline without retrieval or a policy that rewrites the input, that is
the ``usage.input_tokens`` of the same request. It runs no stage: it is not audited, as ``/tokenize``.

Errors come in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with its
status codes (a body that does not fit the schema is a 400, as Anthropic's).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import Response

from pipeline.context import RequestContext, chat_turns
from pipeline.events import Done, Error, Event, TextDelta
from serving.http.anthropic_schemas import CountTokensRequest, MessagesRequest, conversation
from serving.http.openapi import JsonOrEventStream, anthropic_errors
from serving.http.pipeline_routes import PIN_HEADER, answered, response_headers, start_request, started
from serving.http.problems import Problem, from_final
from serving.http.served import event_stream, sse_event
from serving.http.services import Services
from serving.http.tokenize_routes import tokenizer_of
from serving.http.tool_replies import HeldReply, call_of, is_cut_call, may_call, offer_tools
from stages import tools

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
_STATUSES = (400, 401, 403, 404, 413, 429, 503, 504)


@post("/v1/messages", summary="Anthropic-compatible message", tags=["anthropic"], status_code=200,
      operation_class=JsonOrEventStream, responses=anthropic_errors(*_STATUSES))
async def create_message(data: JSONBody[MessagesRequest], request: Request,
                         services: NamedDependency[Services]) -> Response[Any]:
    chat = conversation(data)
    user = data.metadata.user_id if data.metadata else None
    pipeline, ctx = await start_request(services, request, data.model, chat.messages, data.overrides(),
                                        {"user": user} if user else None, stop=data.stop_sequences)
    offer_tools(ctx, chat.tools, chat.tool_choice)
    if data.stream:
        return event_stream(_events(await started(services.executor, pipeline, ctx), ctx, data), _headers(ctx))
    return Response(_message(await answered(services.executor, pipeline, ctx), ctx, data), headers=_headers(ctx))


@post("/v1/messages/count_tokens", summary="Anthropic-compatible token count", tags=["anthropic"],
      status_code=200, responses=anthropic_errors(400, 401, 403, 404, 503))
async def count_tokens(data: JSONBody[CountTokensRequest], request: Request,
                       services: NamedDependency[Services]) -> dict[str, int]:
    chat = conversation(data)
    name, _, pin = data.model.partition("@")
    pin = pin or request.headers.get(PIN_HEADER, "")
    pipeline = await services.pinned(name, pin) if pin else services.executor.get(name)
    principal = await services.auth.principal(request)
    services.auth.require(principal, pipeline.spec.access.roles, f"count tokens for pipeline {name!r}")
    tokenizer, _ = await tokenizer_of(services, pipeline)
    ctx = RequestContext(pipeline=name, input_messages=chat.messages, principal=principal,
                         tools=chat.tools, tool_choice=chat.tool_choice)
    prompt = pipeline.prompt_for(ctx)  # a chain's prompt stage's, a workflow's answering step's
    turns = chat_turns(prompt if prompt is not None else chat.messages)
    encode, rendered = tools.prompt_encoder(tokenizer, turns, chat.tools, chat.tool_choice)
    return {"input_tokens": len(encode(rendered))}


def _headers(ctx: RequestContext) -> dict[str, str]:
    """Those of every pipeline call (once the policy stage has counted the request), and Anthropic's."""
    return {**response_headers(ctx), "request-id": ctx.request_id}


def _message(final: Done, ctx: RequestContext, data: MessagesRequest) -> dict[str, Any]:
    summary = final.summary
    call = call_of(ctx, summary.output_text)
    if call is not None:
        content: list[dict[str, Any]] = [_tool_use(call, json.loads(call.arguments))]
        stop_reason, stop_sequence = "tool_use", None
    else:
        cut = is_cut_call(ctx, summary.finish_reason)
        content = [] if cut else [{"type": "text", "text": summary.output_text}]
        stop_reason, stop_sequence = _stop(ctx, summary.finish_reason, data)
    return {**_envelope(ctx, data.model), "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": {"input_tokens": summary.usage.input_tokens,
                                                      "output_tokens": summary.usage.output_tokens}}


def _envelope(ctx: RequestContext, model: str) -> dict[str, Any]:
    return {"id": f"msg_{ctx.request_id}", "type": "message", "role": "assistant", "model": model}


def _tool_use(call: tools.ToolCall, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name, "input": arguments}


def _stop(ctx: RequestContext, finish_reason: str, data: MessagesRequest) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` for a reply that is not a call."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    matched = ctx.facts.get("stop_sequence")
    if finish_reason == "stop" and matched is not None and matched in (data.stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None  # the model's end, or a stop string of the pipeline's own


async def _events(events: AsyncIterator[Event], ctx: RequestContext, data: MessagesRequest) -> AsyncIterator[bytes]:
    """The stream's events, as Anthropic sends them."""
    blocks = _Blocks(ctx, data)
    start = {**_envelope(ctx, data.model), "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": ctx.usage.input_tokens or ctx.prompt_tokens, "output_tokens": 0}}
    try:
        yield sse_event("message_start", {"type": "message_start", "message": start})
        yield sse_event("ping", {"type": "ping"})
        for chunk in blocks.begin():
            yield chunk
        async for event in events:
            if isinstance(event, TextDelta):
                for chunk in blocks.text(event.text):
                    yield chunk
            elif isinstance(event, Done):
                for chunk in blocks.end(event.summary.finish_reason):
                    yield chunk
                usage = event.summary.usage
                yield sse_event("message_delta", {
                    "type": "message_delta", "delta": {"stop_reason": blocks.stop_reason,
                                                       "stop_sequence": blocks.stop_sequence},
                    "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}})
                yield sse_event("message_stop", {"type": "message_stop"})
            elif isinstance(event, Error):
                yield sse_event("error", error_body(from_final(event.kind, event.message, ctx.error)))
    finally:
        await events.aclose()  # type: ignore[attr-defined]


class _Blocks:
    """The streamed reply's one content block: text as it comes, or, while tools are offered, held back
    (:class:`HeldReply`) until it is text after all or, at the end, a ``tool_use``."""

    def __init__(self, ctx: RequestContext, data: MessagesRequest):
        self._ctx, self._data = ctx, data
        self._held = HeldReply(ctx) if may_call(ctx) else None
        self._open = False  # the text block was started
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def begin(self) -> list[bytes]:
        return self._start_text() if self._held is None else []

    def text(self, text: str) -> list[bytes]:
        chunks: list[bytes] = []
        if self._held is not None:
            text = self._held.feed(text) or ""
            if self._held.passing and not self._open:
                chunks += self._start_text()
        if text:
            chunks.append(_delta({"type": "text_delta", "text": text}))
        return chunks

    def end(self, finish_reason: str) -> list[bytes]:
        """The block's last events; sets the stop reason."""
        self.stop_reason, self.stop_sequence = _stop(self._ctx, finish_reason, self._data)
        chunks: list[bytes] = []
        reply = self._held.end(finish_reason) if self._held is not None else None
        if isinstance(reply, tools.ToolCall):
            self.stop_reason, self.stop_sequence = "tool_use", None
            chunks += [_block_start({**_tool_use(reply, {}), "input": {}}),
                       _delta({"type": "input_json_delta", "partial_json": reply.arguments}), _BLOCK_STOP]
        elif reply is not None:  # held text that was no call after all
            chunks += self._start_text()
            if reply:
                chunks.append(_delta({"type": "text_delta", "text": reply}))
        if self._open:
            chunks.append(_BLOCK_STOP)
        return chunks

    def _start_text(self) -> list[bytes]:
        self._open = True
        return [_block_start({"type": "text", "text": ""})]


def _block_start(block: dict[str, Any]) -> bytes:
    return sse_event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})


def _delta(delta: dict[str, Any]) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})


_BLOCK_STOP = sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})


def error_body(problem: Problem) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(problem.status, "api_error" if problem.status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": problem.detail or problem.title}}
    if "request_id" in problem.extra:
        body["request_id"] = problem.extra["request_id"]
    return body


def error_response(problem: Problem) -> Response[Any]:
    """*problem* in Anthropic's shape; a body that does not fit the schema is Anthropic's 400, not a 422."""
    status = 400 if problem.status == 422 else problem.status
    return Response(error_body(problem), status_code=status, headers=problem.headers)


ROUTES = [create_message, count_tokens]
