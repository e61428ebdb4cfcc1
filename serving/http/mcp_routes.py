"""Inferline as an MCP server: ``/mcp`` offers every served pipeline the caller's key may call as a tool.

Streamable HTTP (the ``mcp`` package's server side, serving/http/mcp_server.py), on the app's address,
behind its auth::

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http, \\
            Client(streamable_http_client("http://127.0.0.1:8000/mcp", http_client=http)) as mcp:
        tools = await mcp.list_tools()                      # the pipelines this key may call
        result = await mcp.call_tool("support", {"input": "How do I reset my password?"})

- Every HTTP request to ``/mcp`` needs a key, as every route does: none or a bad one is a 401 problem, and a
  body over ``http.max_body_bytes`` a 413 problem, recorded by the refusal recorder like any other route's.
  A session answers only the key that opened it.
- ``tools/list``: the pipelines whose ``access.roles`` the key's role is in (an admin's: all), each with
  its description and its input schema (serving/runtime/pipeline_tool.py: ``input``, ``tags`` and the
  sampling options the pipeline lets callers set, as ``POST /pipelines/{name}`` takes them; an agent step's
  ``pipeline`` tools offer the same); embeddings pipelines answer vectors, not text, and are not tools. A
  key that may call no pipeline gets an error that says so (:data:`NO_TOOLS`), not an empty list.
- ``tools/call`` runs the pipeline as ``POST /pipelines/{name}`` does, through the same functions
  (serving/http/pipeline_routes.py): the same auth and roles, the policy stage's limits and budgets,
  the audit stage's record, the app's metrics. The answer's text is the result's content, and the JSON
  body ``POST /pipelines/{name}`` would answer (request id, usage, cost, version) its
  ``structuredContent``. A refusal or failure is a result with ``isError``, the problem's detail as its
  text and its problem details as ``structuredContent``; a refusal is audited as that route's is.
- A pipeline added, deployed, activated, rolled back or retired (a file edit, the deploy API, another
  server's deploy through PostgreSQL) sends ``notifications/tools/list_changed`` to the open sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import mcp_types as types
from litestar import Request, asgi
from litestar.types import Receive, Scope, Send
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from pipeline.context import Principal
from pipeline.errors import InferlineError
from pipeline.runner import Pipeline
from serving.http.auth import Authenticator
from serving.http.pipeline_routes import answered, start_request, summary_json
from serving.http.problems import Problem, from_error
from serving.http.state import AppState
from serving.runtime.pipeline_tool import ToolArguments, input_schema

logger = logging.getLogger(__name__)

#: The JSON-RPC error code of ``tools/list`` for a key that may call no pipeline (-32000 to -32099 are
#: the implementation's own).
NO_TOOLS = -32003


async def list_tools(request: Request[Any, Any, Any]) -> list[types.Tool]:
    """``tools/list``: the pipelines the caller may call; an MCP error when there is none."""
    services = AppState.of(request).services
    principal = await services.auth.principal(request)
    tools = [tool_of(p) for p in callable_by(services.auth, principal, services.executor.pipelines.values())]
    if not tools:
        raise MCPError(NO_TOOLS, no_tools_message(principal))
    return tools


async def call_tool(request: Request[Any, Any, Any], name: str, arguments: dict[str, Any]) -> types.CallToolResult:
    """``tools/call``: pipeline *name* run on *arguments* as ``POST /pipelines/{name}`` runs its body."""
    state = AppState.of(request)
    services = state.services
    try:
        args = ToolArguments.model_validate(arguments)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
        return failed(Problem(422, "Unprocessable request", f"the arguments do not fit tool {name[:80]!r}'s "
                              f"inputSchema: {details}", "invalid_body"))
    try:
        pipeline, ctx = await start_request(services, request, name, args.chat(), args.overrides(), args.tags)
        final = await answered(services.executor, pipeline, ctx)
    except Exception as exc:
        if not isinstance(exc, (Problem, InferlineError)):
            logger.exception("mcp: tools/call %s failed", name[:80], exc_info=exc)
        problem = from_error(exc)
        state.note_refusal(request, problem)  # a 401, 403 or 429 is audited as POST /pipelines/{name}'s is
        return failed(problem)
    return types.CallToolResult(content=[types.TextContent(type="text", text=final.summary.output_text)],
                                structured_content=summary_json(final.summary, ctx))


def failed(problem: Problem) -> types.CallToolResult:
    """A tool call's refusal or failure: the problem's detail for the model, its details for the client."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=problem.detail)],
                                structured_content=problem.body(), is_error=True)


def callable_by(auth: Authenticator, principal: Principal | None, pipelines: Iterable[Pipeline]) -> list[Pipeline]:
    """The pipelines *principal* may call that answer text, by name."""
    allowed = []
    for pipeline in sorted(pipelines, key=lambda p: p.name):
        try:
            auth.require(principal, pipeline.spec.access.roles, "call it")
        except Problem:
            continue
        if not pipeline.embeds:
            allowed.append(pipeline)
    return allowed


def no_tools_message(principal: Principal | None) -> str:
    who = f"API key {principal.key_id} (role {principal.role!r})" if principal else "this caller"
    return (f"{who} may call no served pipeline, so /mcp has no tool for it: a pipeline's access.roles names "
            "the roles that may call it (admins may call all)")


def tool_of(pipeline: Pipeline) -> types.Tool:
    """Pipeline *pipeline* as a tool: its name, its description, its arguments."""
    spec = pipeline.spec
    return types.Tool(name=spec.name, title=spec.name, description=spec.description or f"Runs pipeline {spec.name}.",
                      input_schema=input_schema(pipeline))


@asgi("/mcp", copy_scope=False)  # the key's user and the refusal's attempt live in the scope
async def mcp_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    """MCP over streamable HTTP (POST, GET and DELETE, as the transport has them)."""
    await AppState.of(Request(scope)).services.mcp.handle(scope, receive, send)


ROUTES = [mcp_endpoint]
