"""What the OpenAI-shaped routes share (chat and text completions, :mod:`serving.http.openai_routes`; the
Responses API, :mod:`serving.http.responses_routes`): OpenAI's error shape, refusing what is not done by
name, checking offered functions and the tool choice, and the chat turns a conversation becomes. Offering
tools and reading a reply that may be a call: :mod:`serving.http.tool_replies` (the Anthropic routes' too).

Tools travel inside the request context in the chat API's shape (:mod:`stages.tools`): ``[{"type":
"function", "function": {"name", "description", "parameters"}}]``, and a named ``tool_choice`` as
``{"type": "function", "function": {"name": ...}}``; a route with another shape converts to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from litestar.response import Response

from pipeline.context import ChatMessage
from serving.http.problems import Problem, bad_request
from serving.http.schemas import ChatMessageIn
from serving.http.tool_replies import parameters_problem
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


def refuse(names: Sequence[str]) -> None:
    """A 400 naming *names*, the parameters asked for that this server does not do; nothing when none."""
    if names:
        raise bad_request(f"{', '.join(names)}: not supported by this server (a parameter is refused, never "
                          "ignored); send the request without it", names[0])


# -- tools and structured output ------------------------------------------------------------------


def check_functions(offered: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """*offered* (the chat shape), once their names are unique and their ``parameters`` valid schemas of an
    object (meeting OpenAI's strict rules where ``strict: true``); a 400 naming ``tools[i]`` + *where*
    (``.function.parameters``) otherwise."""
    names = [t["function"]["name"] for t in offered]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    for index, function in enumerate(t["function"] for t in offered):
        problem = parameters_problem(function["parameters"])
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
