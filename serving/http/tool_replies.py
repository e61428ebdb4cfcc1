"""Function calling as the OpenAI and Anthropic APIs share it: offering tools to a request, and reading
the reply back as a call or as text.

Both APIs put the offered functions on the request context in OpenAI's shape (``ctx.tools``,
``ctx.tool_choice``: see :mod:`stages.tools`); :func:`offer_tools` adds the ``output`` constraint that
makes a forced call the only thing the model can write. A reply is a call when tools were offered and
it parses as one (:func:`call_of`); a forced call that ``max_tokens`` cut short is neither a call nor
text (:func:`is_cut_call`). Streamed, :class:`HeldReply` holds the text back while it may still be a
call, and says at the end what it was. The OpenAI routes (:mod:`serving.http.openai_common`) and the
Anthropic ones read replies through these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.context import RequestContext
from stages import tools


def offer_tools(ctx: RequestContext, offered: list[dict[str, Any]], choice: str | dict[str, Any],
                schema: dict[str, Any] | None = None) -> None:
    """Offer *offered* (OpenAI's ``tools``) with *choice* (OpenAI's ``tool_choice``); *schema*: a JSON
    schema the reply must match when it is not a call (a response format)."""
    ctx.tools = offered
    ctx.tool_choice = choice
    constrain_output(ctx, schema)


def constrain_output(ctx: RequestContext, schema: dict[str, Any] | None) -> None:
    """Set ``output`` from a response format's *schema* (None: free text) and the tools already offered: a
    forced call is the whole reply, an offered one is the format or a call."""
    forced = tools.forced_names(ctx.tools, ctx.tool_choice)
    if forced:  # a call is the whole reply: a response format has nothing left to shape
        schema = tools.call_schema(ctx.tools, forced)
    elif schema is not None and tools.is_offered(ctx.tools, ctx.tool_choice):  # the format, or a call
        schema = {"anyOf": [schema, tools.call_schema(ctx.tools, list(tools.functions(ctx.tools)))]}
    if schema is not None:
        ctx.params["output"] = {"json_schema": schema}


def parameters_problem(schema: Mapping[str, Any]) -> str | None:
    """Why *schema* cannot be a function's arguments (not a JSON Schema, or not of an object), or None."""
    problem = tools.schema_problem(schema)
    if problem is None and schema.get("type", "object") != "object":
        problem = "the arguments are an object: 'type' must be 'object'"
    return problem


def call_of(ctx: RequestContext, text: str) -> tools.ToolCall | None:
    """The tool call the reply makes, if tools were offered and it is one (else it is text)."""
    return tools.parse_call(text, ctx.tools) if tools.is_offered(ctx.tools, ctx.tool_choice) else None


def is_cut_call(ctx: RequestContext, finish_reason: str) -> bool:
    """Whether the reply is a forced call that ``max_tokens`` cut short: half a call is neither a call nor
    text, so the answer has neither."""
    return finish_reason == "length" and bool(tools.forced_names(ctx.tools, ctx.tool_choice))


def may_call(ctx: RequestContext) -> bool:
    """Whether a streamed reply must be held back (:class:`HeldReply`): tools are offered."""
    return tools.is_offered(ctx.tools, ctx.tool_choice)


class HeldReply:
    """A streamed reply that may be a tool call: its text is held back while it may still be one (all of it
    when a call is forced), then passed on as text, or read at the end as a call."""

    def __init__(self, ctx: RequestContext):
        self._ctx = ctx
        self._forced = bool(tools.forced_names(ctx.tools, ctx.tool_choice))
        self._text = ""
        #: Whether the reply turned out to be text, and is passed on as it comes.
        self.passing = False

    def feed(self, text: str) -> str | None:
        """The text to send now: *text*, or all that was held once it cannot be a call; None while held."""
        if self.passing:
            return text
        self._text += text
        if self._forced or tools.could_be_call(self._text):
            return None
        self.passing = True
        return self._text

    def end(self, finish_reason: str) -> tools.ToolCall | str | None:
        """What the held reply is: a call, or text (all that was held) to send; None when there is nothing
        more to send (the reply was passed on already, or it is a forced call cut short)."""
        if self.passing:
            return None
        call = call_of(self._ctx, self._text)
        if call is not None:
            return call
        return None if is_cut_call(self._ctx, finish_reason) else self._text
