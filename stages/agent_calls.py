"""One round's tool calls of an ``agent`` step: reading them from the model's reply, running each, and
recording each as a step of the request (type ``tool``, under the agent step) with its outcome.

A call is refused before it runs when the model names a tool the step does not offer, when its arguments
break the tool's schema, or (MCP) when the server's schema for it is no longer the pinned one; its result
is refused when the policy's input rails block it. A call that waits for the client's approval is recorded as
``pending`` (status ``skipped``) when the request pauses, and as ``denied`` when the client denies it; an
approved one runs as any other, its record naming the approval (``approval``: approved or denied, and the
``approval_request_id``). The model is told each outcome, never a withheld result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.context import ChatMessage, RequestContext, StageRecord
from pipeline.errors import BackendError, InferlineError, PolicyDenied
from pipeline.events import StageFinished, StageStarted
from pipeline.protocols import Resources, ToolReply
from stages.agent_tools import BoundTool, HttpTool, PipelineTool, argument_errors, sha256_of
from stages.detectors import injection_score

_FENCED = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
#: A record's status for each outcome (the trace's and the audit record's words).
_STATUS = {"ok": "ok", "error": "failed", "timeout": "timeout", "refused": "denied", "denied": "denied",
           "pending": "skipped"}
#: Without a policy step before the agent, tool results still face the injection heuristic at this score.
DEFAULT_INJECTION_THRESHOLD = 0.5


def proposed_calls(text: str) -> list[tuple[str, Any]] | None:
    """The calls a reply proposes, as (name, arguments), or None when it is an answer: one JSON object
    ``{"name", "arguments"}`` (bare, fenced, or in ``<tool_call>`` tags, several tags for several calls) or a
    JSON array of them. Arguments are not checked here (a bad call is refused and told to the model)."""
    body = text.strip()
    fenced = _FENCED.match(body)
    if fenced:
        body = fenced.group(1)
    items: list[Any] = []
    if body.startswith("<tool_call>"):
        for part in _TAGGED.findall(body):
            items.append(_json(part))
    else:
        data = _json(body)
        items = data if isinstance(data, list) and data else [data]
    calls = [_call_of(item) for item in items]
    return None if not calls or any(call is None for call in calls) else calls  # type: ignore[return-value]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_of(item: Any) -> tuple[str, Any] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))  # Llama 3.1 writes "parameters"
    if isinstance(arguments, str):
        arguments = _json(arguments) if arguments.strip() else {}
    return item["name"], arguments


@dataclass(frozen=True, slots=True)
class ProposedCall:
    """One call a model proposed, with the id an approval names it by."""

    id: str
    name: str
    arguments: Any
    #: The SHA-256 of the tool's definition when the call was proposed (what an approval approved).
    schema_sha256: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments, "schema_sha256": self.schema_sha256}


class ToolCaller:
    """Runs the calls of one agent step's request and records each (see the module docstring)."""

    def __init__(self, step_id: str, resources: Resources, ctx: RequestContext, call_timeout_s: float,
                 max_result_chars: int, emit: Callable[[StageStarted | StageFinished], None] | None = None):
        self.step_id = step_id
        #: Where each call's start and end go as they happen (the agent step's StageScope.emit_step: the
        #: client's SSE ``stage`` events, type ``tool``, under the step).
        self.emit = emit or (lambda event: None)
        self.resources = resources
        self.ctx = ctx
        self.call_timeout_s = call_timeout_s
        self.max_result_chars = max_result_chars
        #: Calls made so far, whatever their outcome.
        self.made = 0

    async def call(self, tool: BoundTool | None, name: str, arguments: Any, round_: int,
                   approved: ProposedCall | None = None) -> str:
        """Run one proposed call (*approved*: as the client approved it); what the model is told of it."""
        self.made += 1
        started = time.perf_counter()
        self.emit(StageStarted(name, "tool"))
        outcome, told, result, detail = "ok", "", "", ""
        try:
            if tool is None:
                raise _Refused(f"no tool {name!r} is offered")
            if approved is not None and approved.schema_sha256 != tool.schema_sha256:
                raise _Refused(f"tool {name!r} changed since this call was approved; it did not run")
            if problems := argument_errors(tool, arguments):
                raise _Refused(f"invalid arguments: {'; '.join(problems)}")
            async with asyncio.timeout(self.call_timeout_s):
                reply = await self._run(tool, arguments)
            result = reply.text[:self.max_result_chars]
            told = self._screen(result, name)
            outcome = "error" if reply.is_error else "ok"
        except _Refused as exc:
            outcome, detail = "refused", str(exc)
            told = f"refused: {exc}"
        except TimeoutError:
            outcome, detail = "timeout", f"no answer within {self.call_timeout_s:g} s; the call was cancelled"
            told = f"error: {detail}"
        except InferlineError as exc:
            outcome, detail = "error", str(exc)
            told = f"error: {exc}"
        self._record(tool, name, arguments, result, outcome, detail, round_, started,
                     {"approval": "approved", "approval_request_id": approved.id} if approved else {}, told)
        return json.dumps({"name": name, "outcome": outcome, "content": told}, ensure_ascii=False)

    async def deny(self, tool: BoundTool | None, call: ProposedCall, round_: int) -> str:
        """Record a call the client denied (or left unanswered) when resuming; what the model is told of it."""
        self.made += 1
        self.emit(StageStarted(call.name, "tool"))
        detail = "the user denied this call (it needed approval); it did not run"
        self._record(tool, call.name, call.arguments, "", "denied", detail, round_, time.perf_counter(),
                     {"approval": "denied", "approval_request_id": call.id})
        return json.dumps({"name": call.name, "outcome": "denied", "content": f"denied: {detail}"},
                          ensure_ascii=False)

    def pend(self, tool: BoundTool, call: ProposedCall, round_: int) -> None:
        """Record a call the request paused on, waiting for the client's approval."""
        self.emit(StageStarted(call.name, "tool"))
        self._record(tool, call.name, call.arguments, "", "pending", "waiting for the client's approval", round_,
                     time.perf_counter(), {"approval": "pending", "approval_request_id": call.id})

    async def _run(self, tool: BoundTool, arguments: dict[str, Any]) -> ToolReply:
        provider = self.resources.tools
        if isinstance(tool.spec, PipelineTool):
            return await self._run_pipeline(tool.spec, arguments)
        if provider is None:
            raise BackendError("this process runs no tools: an agent step runs under `inferline serve`")
        if isinstance(tool.spec, HttpTool):
            spec = tool.spec
            return await provider.call_http(spec.method, spec.url, arguments, spec.headers_from,
                                            spec.max_response_bytes)
        current = (await provider.list_mcp(tool.server)).get(tool.name)
        if current is None or current.sha256 != tool.schema_sha256:
            raise _Refused(f"the MCP server {tool.server!r} changed tool {tool.name!r} since this pipeline version "
                           "pinned it (schema drift); deploy a new version to accept it")
        return await provider.call_mcp(tool.server, tool.name, arguments)

    async def _run_pipeline(self, spec: PipelineTool, arguments: dict[str, Any]) -> ToolReply:
        """Run the callee on the call's arguments, as ``POST /pipelines/{name}`` runs its body: ``input`` the user
        message, ``tags``, the rest sampling options (the schema offered allowed only those the callee takes)."""
        caller = self.resources.pipelines
        if caller is None:
            raise BackendError("this process runs no other pipelines: a pipeline tool runs under `inferline serve`")
        name, _, version = spec.pipeline.partition("@")
        ctx, params = self.ctx, {name: value for name, value in arguments.items() if value is not None}
        text, tags = str(params.pop("input")), {str(k): str(v) for k, v in (params.pop("tags", None) or {}).items()}
        child = RequestContext(name, [ChatMessage("user", text)], principal=ctx.principal, tags=tags, params=params,
                               operation=ctx.operation, client_addr=ctx.client_addr, parent_request=ctx.request_id)
        await caller.call_nested(name, version or None, child,  # the callee's roles apply to this caller's key
                                 on_step=lambda event: self.emit(dataclasses.replace(
                                     event, parent=f"{spec.name}/{event.parent}" if event.parent else spec.name)))
        since = (child.received_at - ctx.received_at).total_seconds()
        ctx.stages += [dataclasses.replace(r, parent=f"{self.step_id}/{spec.name}" + (f"/{r.parent}" if r.parent
                                                                                       else ""),
                                           started_s=r.started_s + since) for r in child.stages]
        ctx.usage.input_tokens += child.usage.input_tokens
        ctx.usage.output_tokens += child.usage.output_tokens
        if child.status == "denied":
            raise _Refused(f"pipeline {name!r} refused this caller: {child.error}")
        return ToolReply(child.output_text, child.status != "ok")

    def _screen(self, text: str, name: str) -> str:
        """*text* through the policy's input rails (redacted as they say); _Refused when they block it."""
        rails = self.ctx.facts.get("input_rails")
        try:
            if rails is not None:
                return rails(text, f"tool:{name}")
        except PolicyDenied as exc:
            raise _Refused(f"the result was withheld by policy ({exc.rule or exc.category})") from None
        if injection_score(text).score >= DEFAULT_INJECTION_THRESHOLD:
            raise _Refused("the result was withheld: it reads as a prompt injection")
        return text

    def _record(self, tool: BoundTool | None, name: str, arguments: Any, result: str, outcome: str, detail: str,
                round_: int, started: float, approval: dict[str, str], told: str = "") -> None:
        since = time.perf_counter() - started
        at = (datetime.now(UTC) - self.ctx.received_at).total_seconds() - since
        record = StageRecord(name, "tool", _STATUS[outcome], started_s=max(0.0, at), duration_s=since, error=detail,
                             parent=self.step_id, skip_reason="approval" if outcome == "pending" else "")
        record.tool = {"kind": tool.kind if tool else "", "server": tool.server if tool else "", "tool": name,
                       "schema_sha256": tool.schema_sha256 if tool else "",
                       "allowlist_sha256": tool.allowlist_sha256 if tool else "",
                       "arguments_sha256": sha256_of(arguments), "result_sha256": sha256_of(result) if result else "",
                       "outcome": outcome, "round": round_, "duration_ms": round(since * 1e3, 3), **approval}
        record.inputs, record.output = {"arguments": arguments}, {"result": result}
        self.ctx.stages.append(record)
        self.emit(StageFinished(name, "tool", record.status, since, 0.0, detail, skip_reason=record.skip_reason))
        if outcome != "pending":  # a pending call is shown as its approval request
            calls = self.ctx.facts.setdefault("tool_calls", [])
            calls.append({"step": self.step_id, "id": f"mcp_{self.ctx.request_id[:24]}_{len(calls)}",
                          "kind": record.tool["kind"], "server": record.tool["server"], "name": name,
                          "arguments": arguments, "outcome": outcome, "output": told if outcome == "ok" else None,
                          "error": None if outcome == "ok" else detail or told,
                          "approval_request_id": approval.get("approval_request_id")})
        if self.resources.tools is not None:
            self.resources.tools.count(name, outcome)


class _Refused(Exception):
    """A call refused before it ran, or a result withheld."""
