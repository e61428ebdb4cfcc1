"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

``model`` names a pipeline, as in the chat API (:mod:`serving.http.openai_routes`), whose machinery this
shares: the request runs the pipeline (policy, limits, audit, costs), ``user`` is its ``user`` tag,
``text.format`` (``json_object``, ``json_schema``) and function ``tools`` become the same ``output``
constraint as ``response_format`` and ``tools`` there, and a parameter this server does not do
(``reasoning``, ``include``, ``background``, built-in tools, image or file inputs...) is refused by name
with a 400, never ignored. ``{"type": "mcp"}`` tools name servers of ``inferline.yaml`` and run on the server
(:mod:`serving.http.openai_mcp`); a tool call that needs approval ends the response with
``mcp_approval_request`` items, and ``mcp_approval_response`` input items with ``previous_response_id``
resume it (:mod:`serving.http.approvals`).

``input`` is a string (one user message) or a list of items: messages (``role`` user, assistant, system
or developer; ``content`` a string or ``input_text``/``output_text`` parts), ``function_call`` and
``function_call_output`` items; ``instructions`` is a system message before them. The answer is a
``response`` object whose ``output`` is one ``message`` item (``output_text``) or one ``function_call``
item; ``status`` is ``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the token limit
cut it. Streamed (``stream: true``), it is OpenAI's event sequence: ``response.created``,
``response.in_progress``, the item's ``output_item.added``, ``content_part.added``, ``output_text.delta``
... ``.done`` (or ``function_call_arguments.delta``/``.done``), ``output_item.done``, then
``response.completed`` or ``response.incomplete`` with the usage; a failure after the start is an
``error`` event.

With ``store: true`` (the default) the response and its whole conversation are kept
(:mod:`store.responses`) for ``responses.retention_days`` (``inferline.yaml``): ``GET`` returns it,
``DELETE`` deletes it, and ``previous_response_id`` continues it (its conversation comes before this
input; its ``instructions`` do not). Only the API key that made a response reads, continues or deletes
it (with auth off, anyone); for another key it does not exist (404). Expired responses are never
returned, and are deleted at start and hourly (:func:`prune_expired`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from litestar import Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.response import Response
from sqlalchemy.exc import SQLAlchemyError

from pipeline.context import ChatMessage, Principal, RequestContext
from pipeline.events import Done, Error, Event, TextDelta
from serving.http import approvals, openai_mcp
from serving.http.openai_common import (
    chat_turns,
    check_choice,
    check_functions,
    refuse,
)
from serving.http.openapi import JsonOrEventStream, openai_errors
from serving.http.pipeline_routes import answered, response_headers, start_request, started
from serving.http.problems import Problem, bad_request, checked, from_final
from serving.http.responses_input import chat_messages, input_items
from serving.http.schemas import (
    RESPONSES_TEXT,
    RESPONSES_TOOL_CHOICE,
    RESPONSES_TOOLS,
    JsonObjectFormat,
    ResponsesJsonSchemaFormat,
    ResponsesNamedChoice,
    ResponsesRequest,
    ResponsesText,
)
from serving.http.served import event_stream, sse_event
from serving.http.services import Services
from serving.http.tool_replies import HeldReply, call_of, constrain_output, is_cut_call
from stages import tools
from store.db import utcnow
from store.responses import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

#: How often expired responses are deleted, in seconds (and once at start).
PRUNE_EVERY_S = 3600.0

_CHOICES = """'auto', 'none', 'required' or {"type": "function", "name": ...}"""


@post("/v1/responses", summary="OpenAI Responses API: create a response", tags=["openai"], status_code=200,
      operation_class=JsonOrEventStream, responses=openai_errors(400, 401, 403, 404, 413, 422, 429, 503, 504))
async def create_response(data: JSONBody[ResponsesRequest], request: Request,
                          services: NamedDependency[Services]) -> Response[Any]:
    refuse(sorted(data.model_extra or {}))
    items = input_items(data.input)
    text = checked(RESPONSES_TEXT, data.text, "text") or ResponsesText()
    functions, mcp = openai_mcp.split_tools(data.tools, services.runtime.resources.catalog.mcp_servers, True)
    offered = checked(RESPONSES_TOOLS, functions, "tools") or []
    choice = checked(RESPONSES_TOOL_CHOICE, data.tool_choice, "tool_choice", _CHOICES)
    pipeline, ctx = await start_request(services, request, data.model, [], data.overrides(),
                                        {"user": data.user} if data.user else None)
    earlier = await _continued(services.responses, data.previous_response_id, ctx.principal)
    if mcp:
        pipeline = openai_mcp.agent_pipeline(services, pipeline, mcp)
    if decisions := {i["approval_request_id"]: i["approve"] for i in items if i["type"] == "mcp_approval_response"}:
        if data.previous_response_id is None:
            raise bad_request("input: an mcp_approval_response answers the response that asked for it: send its id "
                              "as previous_response_id", "previous_response_id")
        await approvals.resume(services, pipeline, ctx, data.previous_response_id.removeprefix("resp_"), decisions,
                               "previous_response_id")
    if data.store:  # only a stored response can be answered (previous_response_id)
        approvals.offer(services, ctx)
    system = [ChatMessage("system", data.instructions)] if data.instructions else []
    ctx.input_messages = system + chat_turns(chat_messages(earlier + items))
    ctx.tools = check_functions([_chat_tool(t.model_dump()) for t in offered], ".parameters")
    ctx.tool_choice = check_choice({"type": "function", "function": {"name": choice.name}}
                                   if isinstance(choice, ResponsesNamedChoice) else choice,
                                   list(tools.functions(ctx.tools)))
    fmt = text.format
    if isinstance(fmt, ResponsesJsonSchemaFormat) and fmt.strict and (problem := tools.strict_problem(fmt.schema_)):
        raise bad_request(f"text.format.schema: {problem}", "text")
    constrain_output(ctx, {"type": "object"} if isinstance(fmt, JsonObjectFormat) else
                     fmt.schema_ if isinstance(fmt, ResponsesJsonSchemaFormat) else None)
    made = _Made(data, ctx, int(time.time()), earlier + items, text,
                 [t.model_dump() for t in offered] + (data.tools if mcp else []))
    if data.stream:
        return event_stream(_events(await started(services.executor, pipeline, ctx), made, services),
                            response_headers(ctx))
    final = await answered(services.executor, pipeline, ctx)
    output, status = _output(ctx, final.summary.output_text, final.summary.finish_reason, made.mcp_items())
    body = made.body(status, output, final)
    await _keep(services, made, body, output)
    return Response(body, headers=response_headers(ctx))


@get("/v1/responses/{response_id:str}", summary="OpenAI Responses API: a stored response", tags=["openai"],
     responses=openai_errors(401, 403, 404, 503))
async def get_response(response_id: FromPath[str], request: Request,
                       services: NamedDependency[Services]) -> dict[str, Any]:
    principal = await services.auth.authorize(request, ("caller",), "read responses")
    stored = await asyncio.to_thread(services.responses.get, response_id, _owner(principal))
    if stored is None:
        raise _not_found(response_id, None)
    return stored.body


@delete("/v1/responses/{response_id:str}", summary="OpenAI Responses API: delete a stored response",
        tags=["openai"], status_code=200, responses=openai_errors(401, 403, 404, 503))
async def delete_response(response_id: FromPath[str], request: Request,
                          services: NamedDependency[Services]) -> dict[str, Any]:
    principal = await services.auth.authorize(request, ("caller",), "delete responses")
    if not await asyncio.to_thread(services.responses.delete, response_id, _owner(principal)):
        raise _not_found(response_id, None)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def prune_expired(store: ResponseStore, every_s: float = PRUNE_EVERY_S) -> None:
    """Delete the expired stored responses now, then every *every_s* seconds (until cancelled); a pass that
    fails (the database is away) is logged and tried again next time."""
    while True:
        try:
            pruned = await asyncio.to_thread(store.prune)
        except SQLAlchemyError as exc:
            logger.warning("expired responses not pruned: %s", exc)
        else:
            if pruned:
                logger.info("pruned %d expired response(s)", pruned)
        await asyncio.sleep(every_s)


# -- the input ------------------------------------------------------------------------------------


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A flat Responses function tool in the chat API's shape, which :mod:`stages.tools` reads."""
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool["description"] or "",
        "parameters": tool["parameters"] if tool["parameters"] is not None else {"type": "object",
                                                                                  "properties": {}},
        **({"strict": True} if tool.get("strict") else {})}}


async def _continued(store: ResponseStore, previous_id: str | None,
                     principal: Principal | None) -> list[dict[str, Any]]:
    """The conversation that *previous_id* ends (none without one); 404 if the caller cannot see it."""
    if previous_id is None:
        return []
    stored = await asyncio.to_thread(store.get, previous_id, _owner(principal))
    if stored is None:
        raise _not_found(previous_id, "previous_response_id")
    return stored.conversation


# -- the response ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Made:
    """What a response object is made of besides its output: the request, and the conversation so far."""

    data: ResponsesRequest
    ctx: RequestContext
    created_at: int
    conversation: list[dict[str, Any]]
    text: ResponsesText
    tools: list[dict[str, Any]]

    def mcp_items(self) -> list[dict[str, Any]]:
        """What the request's own mcp tools did (none without them: a pipeline's own tools are its business)."""
        return openai_mcp.mcp_items(self.ctx) if any(t.get("type") == "mcp" for t in self.tools) else []

    @property
    def id(self) -> str:
        return f"resp_{self.ctx.request_id}"

    def body(self, status: str, output: list[dict[str, Any]], final: Done | None) -> dict[str, Any]:
        data = self.data
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": data.model, "output": output,
            "output_text": "".join(part["text"] for item in output if item["type"] == "message"
                                   for part in item["content"]),
            "usage": None if final is None else _usage(final),
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "previous_response_id": data.previous_response_id, "instructions": data.instructions,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tools": self.tools, "tool_choice": data.tool_choice if data.tool_choice is not None else "auto",
            "temperature": data.temperature, "top_p": data.top_p, "max_output_tokens": data.max_output_tokens,
            "parallel_tool_calls": data.parallel_tool_calls is not False, "store": data.store,
            "metadata": data.metadata or {}, "user": data.user,
        }


def _output(ctx: RequestContext, text: str, finish_reason: str,
            shown: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The output items of a reply, and the response's status: *shown* (what its mcp tools did), then its
    answer."""
    if (awaiting := _approval_items(ctx)) is not None:
        return shown + awaiting, "completed"
    status = "incomplete" if finish_reason == "length" else "completed"
    call = call_of(ctx, text)
    if call is not None:
        return [*shown, _call_item(ctx, call, "completed")], "completed"
    if is_cut_call(ctx, finish_reason):  # half a call is neither a call nor content
        return shown, "incomplete"
    return [*shown, _message_item(ctx, text, status)], status


def _approval_items(ctx: RequestContext) -> list[dict[str, Any]] | None:
    """A paused request's ``mcp_approval_request`` items, one per call awaiting approval; None: not paused."""
    pending = approvals.pending_requests(ctx)
    return None if pending is None else [{"type": "mcp_approval_request", **request} for request in pending]


def _message_item(ctx: RequestContext, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": f"msg_{ctx.request_id}", "role": "assistant", "status": status,
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(ctx: RequestContext, call: tools.ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{ctx.request_id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def _usage(final: Done) -> dict[str, Any]:
    usage = final.summary.usage
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


async def _keep(services: Services, made: _Made, body: dict[str, Any], output: list[dict[str, Any]]) -> None:
    """Store the response (``store: true``) with its conversation, until the retention runs out; a 503 when
    the database cannot take it (a response said to be stored is one)."""
    if not made.data.store:
        return
    created = utcnow()
    days = services.runtime.workspace.server.responses.retention_days
    conversation = made.conversation + [
        {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
        if item["type"] == "function_call" else
        {"type": "message", "role": "assistant", "content": "".join(p["text"] for p in item["content"])}
        if item["type"] == "message" else item
        for item in output]
    stored = StoredResponse(made.id, _owner(made.ctx.principal), made.ctx.pipeline, conversation, body, created,
                            None if days is None else created + timedelta(days=days))
    try:
        await asyncio.to_thread(services.responses.save, stored)
    except SQLAlchemyError as exc:
        logger.warning("response %s not stored: %s", made.id, exc)
        raise Problem(503, "Backend unavailable", "the response was made but could not be stored; retry, or send "
                      "store: false", "backend_error", {"Retry-After": "5"}) from exc


async def _events(events: AsyncIterator[Event], made: _Made, services: Services) -> AsyncIterator[bytes]:
    """The response as OpenAI's stream of events, each with its ``sequence_number``."""
    ctx = made.ctx
    numbers = itertools.count()

    def send(kind: str, **payload: Any) -> bytes:
        return sse_event(kind, {"type": kind, "sequence_number": next(numbers), **payload})

    held = HeldReply(ctx) if tools.is_offered(ctx.tools, ctx.tool_choice) else None
    message = _MessageEvents(f"msg_{ctx.request_id}", send)
    shown: list[dict[str, Any]] | None = None  # the mcp items, sent before the first of the answer's

    def show_tools() -> bytes:
        """The mcp items' events, once: the calls are made before any text of the answer is sent."""
        nonlocal shown
        if shown is not None:
            return b""
        shown = made.mcp_items()
        message.index = len(shown)
        return b"".join(_mcp_events(send, index, item) for index, item in enumerate(shown))

    try:
        started = made.body("in_progress", [], None)
        yield send("response.created", response=started)
        yield send("response.in_progress", response=started)
        async for event in events:
            if isinstance(event, TextDelta):
                content = held.feed(event.text) if held is not None else event.text
                if content:
                    yield show_tools() + message.delta(content)
            elif isinstance(event, Done):
                finish = event.summary.finish_reason
                status = "incomplete" if finish == "length" else "completed"
                reply = held.end(finish) if held is not None and not held.passing else message.text
                if head := show_tools():
                    yield head
                at = message.index
                if (awaiting := _approval_items(ctx)) is not None:
                    output, status = awaiting, "completed"
                    for index, item in enumerate(awaiting, at):
                        yield send("response.output_item.added", output_index=index, item=item)
                        yield send("response.output_item.done", output_index=index, item=item)
                elif isinstance(reply, tools.ToolCall):
                    item = _call_item(ctx, reply, "completed")
                    output, status = [item], "completed"
                    yield send("response.output_item.added", output_index=at,
                               item={**item, "arguments": "", "status": "in_progress"})
                    yield send("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                               delta=reply.arguments)
                    yield send("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                               name=reply.name, arguments=reply.arguments)
                    yield send("response.output_item.done", output_index=at, item=item)
                elif reply is None:  # a forced call cut short: no output
                    output, status = [], "incomplete"
                else:
                    if reply != message.text:  # the held text, which turned out to be content
                        yield message.delta(reply)
                    output = [_message_item(ctx, message.text, status)]
                    yield message.done(output[0])
                output = (shown or []) + output
                body = made.body(status, output, event)
                try:
                    await _keep(services, made, body, output)
                except Problem as problem:
                    yield _error(send, problem)
                    continue
                yield send("response.completed" if status == "completed" else "response.incomplete", response=body)
            elif isinstance(event, Error):
                yield _error(send, from_final(event.kind, event.message, ctx.error))
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _mcp_events(send: Callable[..., bytes], index: int, item: dict[str, Any]) -> bytes:
    """An ``mcp_list_tools`` or ``mcp_call`` item's events, as OpenAI streams them once the item is complete."""
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "mcp_list_tools":
        middle = send("response.mcp_list_tools.completed", **where)
    else:
        middle = (send("response.mcp_call_arguments.done", **where, arguments=item["arguments"])
                  + send("response.mcp_call.completed" if item["status"] == "completed" else "response.mcp_call.failed",
                         **where))
    return (send("response.output_item.added", output_index=index, item=item) + middle
            + send("response.output_item.done", output_index=index, item=item))


def _error(send: Callable[..., bytes], problem: Problem) -> bytes:
    return send("error", code=problem.kind, message=problem.detail or problem.title, param=None)


class _MessageEvents:
    """The events of the one message item of a streamed response: opened at its first text."""

    def __init__(self, item_id: str, send: Callable[..., bytes]):
        self.item_id = item_id
        #: Its place in the output (after the mcp items).
        self.index = 0
        self.text = ""
        self._send = send
        self._opened = False

    def _open(self) -> bytes:
        self._opened = True
        item = {"type": "message", "id": self.item_id, "role": "assistant", "status": "in_progress", "content": []}
        return (self._send("response.output_item.added", output_index=self.index, item=item)
                + self._send("response.content_part.added", item_id=self.item_id, output_index=self.index,
                             content_index=0, part=_text_part("")))

    def delta(self, text: str) -> bytes:
        head = b"" if self._opened else self._open()
        self.text += text
        return head + self._send("response.output_text.delta", item_id=self.item_id, output_index=self.index,
                                 content_index=0, delta=text, logprobs=[])

    def done(self, item: dict[str, Any]) -> bytes:
        head = b"" if self._opened else self._open()
        where = {"item_id": self.item_id, "output_index": self.index, "content_index": 0}
        return (head + self._send("response.output_text.done", **where, text=self.text, logprobs=[])
                + self._send("response.content_part.done", **where, part=_text_part(self.text))
                + self._send("response.output_item.done", output_index=self.index, item=item))


def _owner(principal: Principal | None) -> str | None:
    """Whose responses a caller sees: its key's; None (everyone's) with auth off."""
    return principal.key_id if principal is not None else None


def _not_found(response_id: str, param: str | None) -> Problem:
    # The same answer whether it never existed, expired, was deleted, or is another key's.
    return Problem(404, "Not found", f"no response {response_id!r}", "response_not_found", extra={"param": param})


ROUTES = [create_response, get_response, delete_response]
