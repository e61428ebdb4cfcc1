"""OpenAI's ``{"type": "mcp"}`` tools on ``/v1/chat/completions`` and ``/v1/responses``, run by the server.

    {"type": "mcp", "server_label": "orders", "allowed_tools": ["order_status"], "require_approval": "never"}

``server_label`` names a server of ``mcp_servers:`` in ``inferline.yaml``; a client never brings its own
server (``server_url``, ``connector_id``, ``authorization``, ``headers``: a 400 that says so). ``allowed_tools``
(a list of names, or ``{"tool_names": [...]}``) is required: no list, no tools. ``require_approval`` is
``always`` (OpenAI's default), ``never``, or ``{"always": {"tool_names": [...]}}`` /
``{"never": {"tool_names": [...]}}``; a call that needs approval ends a Responses request with an
``mcp_approval_request`` item (serving/http/approvals.py). Chat completions cannot pause, so they take
``require_approval: "never"`` only.

The request then runs :func:`agent_pipeline`: the named pipeline's ``policy`` steps, one ``agent`` step over its
model (the first ``model:`` and ``system:`` of its ``llm``/``agent`` steps; none: the server's first model) with
these tools and the client's turns (``history``), and its ``audit`` steps; the pipeline's other steps
(retrieval, routing, a fixed prompt) do not run. It is built for the request and pins the tools' definitions as
it starts, so drift is caught within a request; across requests each starts from the definitions listed then
(for pinned definitions across requests, declare the tools in a pipeline file).

On the Responses API the output shows what the tools did before the message, as OpenAI's does:
``mcp_list_tools`` and ``mcp_call`` items (:func:`mcp_items`; streamed, each with its ``response.mcp_*`` event).
Sent back as input they are accepted and not read by the model; chat completions show none (their API has
no place for them).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from pipeline.context import RequestContext
from pipeline.errors import SpecError
from pipeline.loader import load_pipeline_text
from pipeline.runner import Pipeline
from serving.http.problems import bad_request
from serving.http.services import Services

#: The id of the agent step a request with MCP tools runs (its audit record and trace name it).
AGENT_STEP = "mcp_tools"
#: Keys of OpenAI's mcp tool that bring a server or credentials of the client's: never accepted.
_CLIENT_SERVER = ("server_url", "connector_id", "authorization", "headers", "tunnel_id")
_KEYS = {"type", "server_label", "allowed_tools", "require_approval", "server_description", *_CLIENT_SERVER}


def split_tools(value: Any, servers: frozenset[str], may_pause: bool) -> tuple[Any, list[dict[str, Any]]]:
    """*value* (a request's ``tools``) without its mcp tools, and those as an agent step's tool specs; a 400
    for an mcp tool this server does not run (see the module docstring)."""
    if not isinstance(value, list) or not any(isinstance(t, dict) and t.get("type") == "mcp" for t in value):
        return value, []
    others = [t for t in value if not (isinstance(t, dict) and t.get("type") == "mcp")]
    if others:
        raise bad_request("tools: mcp tools run on this server and function tools on the client; send one kind "
                          "per request", "tools")
    return None, [_spec(tool, f"tools[{i}]", servers, may_pause) for i, tool in enumerate(value)]


def _spec(tool: dict[str, Any], where: str, servers: frozenset[str], may_pause: bool) -> dict[str, Any]:
    known = ", ".join(sorted(servers)) or "none"
    if given := [key for key in _CLIENT_SERVER if tool.get(key) is not None]:
        raise bad_request(f"{where}.{given[0]}: this server runs only the MCP servers of its inferline.yaml "
                          f"(mcp_servers: {known}), never one a request names; send server_label alone", "tools")
    if unknown := sorted(set(tool) - _KEYS):
        raise bad_request(f"{where}: {', '.join(unknown)}: not supported by this server in an mcp tool", "tools")
    label = tool.get("server_label")
    if label not in servers:
        raise bad_request(f"{where}.server_label: no MCP server {label!r} here (mcp_servers: {known})", "tools")
    allowed = tool.get("allowed_tools")
    if isinstance(allowed, dict) and set(allowed) <= {"tool_names", "read_only"}:
        allowed = allowed.get("tool_names")
    if not isinstance(allowed, list) or not allowed or not all(isinstance(n, str) for n in allowed):
        raise bad_request(f"{where}.allowed_tools: list the tools of {label!r} the model may call (a list of "
                          "names, or {\"tool_names\": [...]}); without a list none is offered", "tools")
    approval = _approval(tool.get("require_approval", "always"), allowed, f"{where}.require_approval")
    if approval != "never" and not may_pause:
        raise bad_request(f"{where}.require_approval: chat completions cannot pause for approval; send \"never\", "
                          "or call POST /v1/responses, which can", "tools")
    return {"kind": "mcp", "server": label, "allow": list(dict.fromkeys(allowed)), "require_approval": approval}


def _approval(value: Any, allowed: list[str], where: str) -> Any:
    """OpenAI's ``require_approval`` as an agent tool's (always, never, or ``{tools: [...]}``)."""
    if value in ("always", "never"):
        return value
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ("always", "never"):
        side, names = next(iter(value.items()))
        names = names.get("tool_names") if isinstance(names, dict) else None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            listed = [n for n in allowed if n in names] if side == "always" else [n for n in allowed if n not in names]
            return {"tools": listed} if listed else "never"
    raise bad_request(f"{where}: expected \"always\", \"never\", {{\"always\": {{\"tool_names\": [...]}}}} or "
                      f"{{\"never\": {{\"tool_names\": [...]}}}}", "tools")


def mcp_items(ctx: RequestContext) -> list[dict[str, Any]]:
    """The Responses output items that show what the request's mcp tools did, before its message: an
    ``mcp_list_tools`` per server (on a request that does not resume an approval: the resumed one listed them)
    and an ``mcp_call`` per call, its ``output`` what the model was told of the result (after the policy's
    rails), or its ``error``. Only the tools the request brought (:data:`AGENT_STEP`): a pipeline's own tools are
    its business, kept in its audit record."""
    rid, items = ctx.request_id[:24], []
    if "approval_resume" not in ctx.facts:
        items += [{"type": "mcp_list_tools", "id": f"mcpl_{rid}_{i}", "server_label": listed["server"],
                   "tools": listed["tools"], "error": None}
                  for i, listed in enumerate(ctx.facts.get("tools_listed", [])) if listed["step"] == AGENT_STEP]
    for call in ctx.facts.get("tool_calls", []):
        if call["step"] != AGENT_STEP or call["kind"] != "mcp":
            continue
        error = call["error"]
        items.append({"type": "mcp_call", "id": call["id"], "server_label": call["server"], "name": call["name"],
                      "arguments": json.dumps(call["arguments"], ensure_ascii=False), "output": call["output"],
                      "error": None if error is None else {"type": "mcp_tool_execution_error",
                                                           "content": [{"type": "text", "text": error}]},
                      "status": "completed" if error is None else "failed",
                      "approval_request_id": call["approval_request_id"]})
    return items


def agent_pipeline(services: Services, pipeline: Pipeline, specs: list[dict[str, Any]]) -> Pipeline:
    """*pipeline*'s policy and audit steps around one agent step over its model with *specs* (the module
    docstring); a 400 when the tools do not load (a tool the server does not offer shows at the first call)."""
    stages = pipeline.spec.to_dict()["stages"]
    calls = [plan for plan in pipeline.loaded.plans if plan.cls.is_model_call]
    agent: dict[str, Any] = {"tools": specs, "history": True}
    for key, read in (("model", lambda plan: plan.cls.model_of(plan.config)),
                      ("system", lambda plan: getattr(plan.config, "system", None))):
        if (found := next((value for plan in calls if (value := read(plan))), None)) is not None:
            agent[key] = found
    head = [{k: v for k, v in s.items() if k != "needs"} for s in stages if s["type"] == "policy"]
    tail = [{k: v for k, v in s.items() if k != "needs"} for s in stages if s["type"] == "audit"]
    spec = {"name": pipeline.name, **({"version": pipeline.spec.version} if pipeline.spec.version else {}),
            "stages": [*head, {"id": AGENT_STEP, "type": "agent", "with": agent}, *tail]}
    workspace, resources = services.runtime.workspace, services.runtime.resources
    try:
        loaded = load_pipeline_text(yaml.safe_dump(spec, sort_keys=False), f"{pipeline.name} (mcp tools)",
                                    workspace.registry, resources.catalog)
    except SpecError as exc:
        raise bad_request(f"tools: {exc}", "tools") from None
    return Pipeline(loaded, resources, versioned=False)
