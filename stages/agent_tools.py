"""The tools an ``agent`` step declares (its ``with: tools:``), and running one call of one of them.

Three kinds::

    tools:
      - kind: http                       # one HTTP request per call
        name: order_lookup
        description: "An order's status and items, by its id."
        method: GET
        url: "http://127.0.0.1:8081/orders/{order_id}"   # {fields} are arguments, percent-encoded whole
        parameters: {type: object, properties: {order_id: {type: string}}, required: [order_id]}
        headers_from: orders_api         # a header set of inferline.yaml's tool_headers: (never the caller's)
        max_response_bytes: 65536
      - kind: mcp                        # tools of an MCP server of inferline.yaml's mcp_servers:
        server: orders
        allow: [order_status]            # only these; no allow list: none of its tools
      - kind: pipeline                   # another served pipeline: its input, tags and the options it takes
        name: ask_handbook
        pipeline: support
        description: "Answers product questions from the handbook."
        require_approval: always         # or never (the default), or {tools: [names]} (an MCP server's)

Every call ends with one outcome: ``ok``, ``error`` (the tool said so, or could not be reached), ``timeout``
(past ``call_timeout_s``: cancelled, on MCP with a cancellation), ``refused`` (a tool the step does not
offer, arguments its schema rejects, an MCP tool whose schema is no longer the one pinned when the pipeline
version loaded, or a result the policy's input rails blocked), ``pending`` (it needs approval: the request
paused before running it) or ``denied`` (the client denied it, or did not approve it, when resuming).
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from pipeline.stage import NoConfig
from stages.subpipeline import CALLEE_PATTERN
from stages.tools import schema_errors, schema_problem

#: A tool's name as models are shown it (OpenAI's rule for function names).
TOOL_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
OUTCOMES = ("ok", "error", "timeout", "refused", "pending", "denied")


class ApprovalList(NoConfig):
    #: The tools (by name) whose calls wait for the client's approval; the others run without.
    tools: list[str] = Field(min_length=1)


#: ``always``: every call of the tool waits for the client's approval; ``never``: none does.
Approval = Literal["always", "never"] | ApprovalList


class HttpTool(NoConfig):
    #: http: one HTTP request per call.
    kind: Literal["http"]
    #: The name the model calls it by.
    name: str = Field(pattern=TOOL_NAME)
    #: What it does, for the model.
    description: str = ""
    #: GET and DELETE send the arguments outside the URL as its query; the others as a JSON body.
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    #: The URL; ``{name}`` fields are arguments (percent-encoded whole); the rest go in the query or JSON body.
    url: str = Field(pattern=r"^https?://")
    #: The JSON Schema of its arguments (an object).
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    #: The header set of ``tool_headers:`` in inferline.yaml sent with it (none: no headers).
    headers_from: str | None = None
    #: A longer response is an error.
    max_response_bytes: int = Field(65536, ge=1, le=16 << 20)
    #: Whether a call waits for the client's approval (stages/agent.py: the request pauses).
    require_approval: Approval = "never"


class McpTools(NoConfig):
    #: mcp: tools of an MCP server of inferline.yaml.
    kind: Literal["mcp"]
    #: A server of ``mcp_servers:`` in inferline.yaml.
    server: str
    #: The tools of that server the model is offered; the others are never shown nor called.
    allow: list[str] = Field(default_factory=list)
    #: Whether a call waits for the client's approval: always, never, or for the tools listed.
    require_approval: Approval = "never"


class PipelineTool(NoConfig):
    #: pipeline: another served pipeline, on the arguments its route takes (input, tags, the sampling options it
    #: lets callers set); the caller's roles apply to it.
    kind: Literal["pipeline"]
    #: The name the model calls it by.
    name: str = Field(pattern=TOOL_NAME)
    #: A served pipeline: ``name`` or ``name@version``.
    pipeline: str = Field(pattern=CALLEE_PATTERN)
    #: What it does, for the model.
    description: str = ""
    #: Whether a call waits for the client's approval.
    require_approval: Approval = "never"


ToolSpec = Annotated[HttpTool | McpTools | PipelineTool, Field(discriminator="kind")]

#: A pipeline tool's arguments until its callee's are read (at each request: stages/agent.py): its input.
PIPELINE_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                       "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class BoundTool:
    """A tool as the model is offered it, with what running it needs."""

    name: str
    kind: str
    description: str
    parameters: dict[str, Any]
    #: The SHA-256 of its definition: pinned from tools/list for an MCP tool, of the spec for the others.
    schema_sha256: str
    spec: HttpTool | McpTools | PipelineTool
    #: An MCP tool's server ("" for the others).
    server: str = ""
    #: An MCP tool's: the SHA-256 of its step's allow list (which tools of the server were granted).
    allowlist_sha256: str = ""

    @property
    def needs_approval(self) -> bool:
        """Whether its calls wait for the client's approval (the spec's ``require_approval``)."""
        return needs_approval(self.spec.require_approval, self.name)

    def offered(self) -> dict[str, Any]:
        """OpenAI's shape, as stages/tools.py renders and parses it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def needs_approval(approval: Literal["always", "never"] | ApprovalList, name: str) -> bool:
    """Whether a call of tool *name* waits for approval under *approval*."""
    return approval == "always" or (isinstance(approval, ApprovalList) and name in approval.tools)


def spec_issues(tools: list[HttpTool | McpTools | PipelineTool], mcp_servers: frozenset[str],
                tool_headers: frozenset[str]) -> list[tuple[tuple[str | int, ...], str]]:
    """Load-time problems of a step's tools: unknown servers and header sets, schemas, names used twice."""
    issues: list[tuple[tuple[str | int, ...], str]] = []
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if isinstance(tool, McpTools):
            if tool.server not in mcp_servers:
                issues.append((("tools", i, "server"), f"no MCP server {tool.server!r} (mcp_servers in "
                                                       f"inferline.yaml: {', '.join(sorted(mcp_servers)) or 'none'})"))
            if not tool.allow:
                issues.append((("tools", i, "allow"), "no tool is allowed: list the tools of this server the model "
                                                      "may call (allow: [name, ...])"))
            given = tool.allow
        else:
            given = [tool.name]
        if isinstance(tool, HttpTool):
            issues += _http_issues(tool, i, tool_headers)
        if isinstance(tool.require_approval, ApprovalList) and (unknown := set(tool.require_approval.tools) -
                                                                set(given)):
            issues.append((("tools", i, "require_approval", "tools"),
                           f"{', '.join(map(repr, sorted(unknown)))}: not a tool of this entry (it offers: "
                           f"{', '.join(given) or 'none'})"))
        for name in given:
            if name in names:
                issues.append((("tools", i), f"tool {name!r} is offered twice (also by tools[{names[name]}])"))
            names.setdefault(name, i)
    return issues


def _http_issues(tool: HttpTool, i: int, tool_headers: frozenset[str]) -> list[tuple[tuple[str | int, ...], str]]:
    issues: list[tuple[tuple[str | int, ...], str]] = []
    if tool.headers_from is not None and tool.headers_from not in tool_headers:
        issues.append((("tools", i, "headers_from"), f"no header set {tool.headers_from!r} (tool_headers in "
                                                     f"inferline.yaml: {', '.join(sorted(tool_headers)) or 'none'})"))
    if (problem := schema_problem(tool.parameters)) is not None:
        issues.append((("tools", i, "parameters"), f"not a valid JSON Schema: {problem}"))
    elif tool.parameters.get("type", "object") != "object":
        issues.append((("tools", i, "parameters"), "a tool's arguments are an object: write type: object"))
    else:
        required = set(tool.parameters.get("required", []))
        for name in url_fields(tool.url):
            if name not in tool.parameters.get("properties", {}) or name not in required:
                issues.append((("tools", i, "url"), f"the URL uses {{{name}}}: make {name!r} a required property "
                                                    "of parameters"))
    return issues


def url_fields(template: str) -> list[str]:
    """The argument names a URL template uses (``{order_id}``)."""
    try:
        return [field for _, field, _, _ in string.Formatter().parse(template) if field]
    except ValueError:
        return []


def definition_sha256(tool: HttpTool | PipelineTool) -> str:
    """The SHA-256 of an http or pipeline tool's definition (its spec, canonical JSON)."""
    text = json.dumps(tool.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def argument_errors(tool: BoundTool, arguments: Any) -> list[str]:
    """Why *arguments* are not what *tool*'s schema asks (nothing: they are)."""
    if not isinstance(arguments, dict):
        return ["/: the arguments are not an object"]
    return schema_errors(arguments, {"type": "object", **tool.parameters})


def sha256_of(value: Any) -> str:
    """The SHA-256 of a value as canonical JSON (a call's arguments, a result's text)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"),
                                                           ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()
