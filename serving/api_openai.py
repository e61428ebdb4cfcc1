"""The OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

``model`` names a pipeline. Streaming sends ``chat.completion.chunk`` objects
(``text_completion`` for completions) and ``data: [DONE]``; with
``stream_options: {include_usage: true}`` a last chunk carries the usage.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
so the official ``openai`` package raises its usual exceptions.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from litestar import Request, get, post
from litestar.params import JSONBody
from litestar.response import Response, Stream
from pydantic import BaseModel, ConfigDict, Field

from pipeline.context import ChatMessage, RequestContext
from pipeline.events import Done, Error, Event, TextDelta
from serving.api_pipelines import GenerationParams, failure, response_headers, start_request
from serving.execution import chain, prime
from serving.problems import Problem, from_final
from serving.state import AppState

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id...: accepted, not used
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class _Common(GenerationParams):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def overrides(self) -> dict[str, Any]:
        params = super().overrides()
        if self.max_completion_tokens is not None:
            params["max_tokens"] = self.max_completion_tokens
        return params

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: str


@post("/v1/chat/completions", summary="OpenAI-compatible chat completion", tags=["openai"], status_code=200)
async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request) -> Response[Any]:
    messages = [ChatMessage("system" if m.role == "developer" else m.role, m.text()) for m in data.messages]
    return await _complete(request, data, messages, "chat.completion")


@post("/v1/completions", summary="OpenAI-compatible text completion", tags=["openai"], status_code=200)
async def completions(data: JSONBody[CompletionRequest], request: Request) -> Response[Any]:
    return await _complete(request, data, [ChatMessage("user", data.prompt)], "text_completion")


@get("/v1/models", summary="The pipelines, as OpenAI models", tags=["openai"])
async def list_models(request: Request) -> dict[str, Any]:
    state = AppState.of(request)
    await state.auth.authorize(request, ("caller", "auditor"), "list models")
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "inferline"}
                                       for name in sorted(state.executor.pipelines)]}


async def _complete(request: Request, data: _Common, messages: list[ChatMessage], kind: str) -> Response[Any]:
    state = AppState.of(request)
    pipeline, ctx = await start_request(state, request, data.model, messages, data.overrides(), stop=data.stops())
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        events = state.executor.stream(pipeline, ctx)
        head = await prime(events)
        if isinstance(head[-1], Error):  # refused or failed before any text: an HTTP error status
            raise failure(head[-1], ctx)
        chunks = _chunks(chain(head, events), ctx, data.model, kind, include_usage)
        return Stream(chunks, media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", **response_headers(ctx)})
    final = await state.executor.run(pipeline, ctx)
    if isinstance(final, Error):
        raise failure(final, ctx)
    return Response(_body(final, ctx, data.model, kind), headers=response_headers(ctx))


def _body(final: Done, ctx: RequestContext, model: str, kind: str) -> dict[str, Any]:
    summary = final.summary
    if kind == "chat.completion":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": summary.output_text},
                                  "finish_reason": _finish(summary.finish_reason), "logprobs": None}
    else:
        choice = {"index": 0, "text": summary.output_text, "finish_reason": _finish(summary.finish_reason),
                  "logprobs": None}
    return {**_envelope(ctx, model, kind), "choices": [choice], "usage": _usage(final)}


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
                  include_usage: bool) -> AsyncIterator[bytes]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    envelope = _envelope(ctx, model, chunk_kind)

    def chunk(delta: dict[str, Any] | str, finish: str | None) -> bytes:
        choice = ({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                  if isinstance(delta, dict) else {"index": 0, "text": delta, "finish_reason": finish})
        body = {**envelope, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return _data(body)

    try:
        if chunk_kind.startswith("chat"):
            yield chunk({"role": "assistant", "content": ""}, None)
        async for event in events:
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text} if chunk_kind.startswith("chat") else event.text, None)
            elif isinstance(event, Done):
                empty: dict[str, Any] | str = {} if chunk_kind.startswith("chat") else ""
                yield chunk(empty, _finish(event.summary.finish_reason))
                if include_usage:
                    yield _data({**envelope, "choices": [], "usage": _usage(event)})
            elif isinstance(event, Error):
                yield _data(error_body(from_final(event.kind, event.message, ctx.error)))
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def error_body(problem: Problem) -> dict[str, Any]:
    return {"error": {"message": problem.detail or problem.title,
                      "type": _ERROR_TYPES.get(problem.status, "server_error"),
                      "param": None, "code": problem.kind}}


def error_response(problem: Problem) -> Response[Any]:
    return Response(error_body(problem), status_code=problem.status, headers=problem.headers)


ROUTES = [chat_completions, completions, list_models]
