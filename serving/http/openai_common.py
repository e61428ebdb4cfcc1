"""What the OpenAI-shaped routes share (chat and text completions, :mod:`serving.http.openai_routes`; the
Responses API, :mod:`serving.http.responses_routes`): OpenAI's error shape, a 400 that names the bad
parameter, the ``output`` constraint that a response format and offered tools become, and reading a reply
that may be a tool call (held back, when streamed, while it may still be one).

Tools travel inside the request context in the chat API's shape (:mod:`stages.tools`): ``[{"type":
"function", "function": {"name", "description", "parameters"}}]``, and a named ``tool_choice`` as
``{"type": "function", "function": {"name": ...}}``; a route with another shape converts to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from litestar.response import Response
from pydantic import TypeAdapter, ValidationError

from pipeline.context import ChatMessage, RequestContext
from serving.http.problems import Problem
from serving.http.schemas import ChatMessageIn
from stages import tools

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error"}


def error_body(problem: Problem) -> dict[str, Any]:
    return {"error": {"message": problem.detail or problem.title,
                      "type": _ERROR_TYPES.get(problem.status, "server_error"),
                      "param": problem.extra.get("param"), "code": problem.kind}}


def error_response(problem: Problem) -> Response[Any]:
    return Response(error_body(problem), status_code=problem.status, headers=problem.headers)


def bad_request(message: str, param: str) -> Problem:
    return Problem(400, "Bad request", message, "invalid_request", extra={"param": param})


def refuse(names: Sequence[str]) -> None:
    """A 400 naming *names*, the parameters asked for that this server does not do; nothing when none."""
    if names:
        raise bad_request(f"{', '.join(names)}: not supported by this server (a parameter is refused, never "
                          "ignored); send the request without it", names[0])


def checked(adapter: TypeAdapter[Any], value: Any, param: str, expected: str = "") -> Any:
    """*value* validated by *adapter*; a 400 naming *param* (and where in it) if it does not fit."""
    if value is None:
        return None
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        if expected:
            raise bad_request(f"{param}: expected {expected}, got {json.dumps(value)[:100]}", param) from None
        where = "; ".join(f"{param}{_path(e['loc'], value)}: {e['msg']}" for e in exc.errors())
        raise bad_request(where, param) from None


def _path(loc: tuple[Any, ...], value: Any) -> str:
    """``[0].function.name``: where in *value* the error is, without the tags that a tagged union puts in
    (``json_schema.json_schema``: the object's ``type``, then its field)."""
    parts, node, tag_skipped = [], value, False
    for part in loc:
        if isinstance(node, dict) and part == node.get("type") and part not in node and not tag_skipped:
            tag_skipped = True
            continue
        parts.append(f"[{part}]" if isinstance(part, int) else f".{part}")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
        tag_skipped = False
    return "".join(parts)


# -- tools and structured output ------------------------------------------------------------------


def check_functions(offered: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """*offered* (the chat shape), once their names are unique and their ``parameters`` valid schemas of an
    object (meeting OpenAI's strict rules where ``strict: true``); a 400 naming ``tools[i]`` + *where*
    (``.function.parameters``) otherwise."""
    names = [t["function"]["name"] for t in offered]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    for index, function in enumerate(t["function"] for t in offered):
        problem = tools.schema_problem(function["parameters"])
        if problem is None and function["parameters"].get("type", "object") != "object":
            problem = "the arguments are an object: 'type' must be 'object'"
        if problem is None and function.get("strict"):
            problem = tools.strict_problem(function["parameters"])
        if problem is not None:
            raise bad_request(f"tools[{index}]{where}: {problem}", "tools")
    return offered


def check_choice(choice: str | dict[str, Any] | None, names: list[str]) -> str | dict[str, Any]:
    """*choice* (``auto`` when None), once the function it names is offered and ``required`` has some."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request(f"tool_choice: no function {name!r} in tools", "tool_choice")
        return choice
    if choice == "required" and not names:
        raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    return choice or "auto"


def constrain_output(ctx: RequestContext, schema: dict[str, Any] | None) -> None:
    """Set ``output`` from the response format's *schema* (None: free text) and the request's tools: a forced
    call is the whole reply, an offered one is the format or a call."""
    forced = tools.forced_names(ctx.tools, ctx.tool_choice)
    if forced:  # a call is the whole reply: a response format has nothing left to shape
        schema = tools.call_schema(ctx.tools, forced)
    elif schema is not None and tools.is_offered(ctx.tools, ctx.tool_choice):  # the format, or a call
        schema = {"anyOf": [schema, tools.call_schema(ctx.tools, list(tools.functions(ctx.tools)))]}
    if schema is not None:
        ctx.params["output"] = {"json_schema": schema}


def chat_turns(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """The turns, with earlier tool calls as the assistant's text and results as user turns (a pipeline's
    prompt builds on the last user turn, and most chat templates know no ``tool`` role)."""
    turns: list[ChatMessage] = []
    for m in messages:
        if m.role == "tool":
            result = tools.result_text(m.text())
            if turns and turns[-1].role == "user" and turns[-1].content.startswith("<tool_response>"):
                turns[-1].content += "\n" + result  # parallel calls' results: one turn
            else:
                turns.append(ChatMessage("user", result))
        elif m.role == "assistant" and m.tool_calls:
            calls = [tools.call_text(c.function.name, c.function.arguments) for c in m.tool_calls]
            turns.append(ChatMessage("assistant", "\n".join([m.text(), *calls]).strip()))
        else:
            turns.append(ChatMessage("system" if m.role == "developer" else m.role, m.text()))
    return turns


# -- the reply ------------------------------------------------------------------------------------


def reply_call(ctx: RequestContext, text: str) -> tools.ToolCall | None:
    """The tool call the reply makes, if tools were offered and it is one (else it is content)."""
    return tools.parse_call(text, ctx.tools) if tools.is_offered(ctx.tools, ctx.tool_choice) else None


def cut_call(ctx: RequestContext, finish_reason: str) -> bool:
    """Whether the reply is a forced call that the token limit cut short: half a call is neither a call nor
    content, so the answer has neither."""
    return finish_reason == "length" and bool(tools.forced_names(ctx.tools, ctx.tool_choice))


class HeldReply:
    """A streamed reply that may be a tool call: its text is held back while it may still be one (all of it
    when a call is forced), then passed on as content, or read at the end as a call."""

    def __init__(self, ctx: RequestContext):
        self._ctx = ctx
        self._forced = bool(tools.forced_names(ctx.tools, ctx.tool_choice))
        self._text = ""
        #: Whether the reply turned out to be content, and is passed on as it comes.
        self.passing = False

    def feed(self, text: str) -> str | None:
        """The content to send now: *text*, or all that was held once it cannot be a call; None while held."""
        if self.passing:
            return text
        self._text += text
        if self._forced or tools.could_be_call(self._text):
            return None
        self.passing = True
        return self._text

    def end(self, finish_reason: str) -> tools.ToolCall | str | None:
        """What the held reply is: a call, or content (the text held) to send; None when there is nothing more
        to send (the reply was passed on already, or it is a forced call cut short: see :attr:`passing`)."""
        if self.passing:
            return None
        call = reply_call(self._ctx, self._text)
        if call is not None:
            return call
        return None if cut_call(self._ctx, finish_reason) else self._text
