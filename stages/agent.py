"""The ``agent`` step: a model that calls the pipeline's own tools, in a bounded loop, then answers.

YAML::

    - id: answer
      type: agent
      with:
        model: smol
        system: "You answer questions about orders. Look them up; never guess."
        user: "{{ input }}"
        tools:                             # http, mcp and pipeline tools: see stages/agent_tools.py
          - {kind: mcp, server: orders, allow: [order_status]}
        max_rounds: 4                      # model calls at most; a model still calling tools after them fails the step
        timeout_s: 60                      # the whole loop
        call_timeout_s: 10                 # one call; past it the call is cancelled (on MCP, with a cancellation)
        max_tokens: 256
        temperature: 0

Each round the model either answers or proposes calls (one JSON object ``{"name", "arguments"}``, or a JSON
array of them to call several at once); the step runs the calls of a round at the same time, puts each
result through the policy's input rails (a ``policy`` step before it: injection, deny rules, PII; without
one, the built-in injection check blocks), and asks again. A result the rails block is withheld: the model is
told so, never shown it. The answer streams as an ``llm`` step's does (a reply that may still be a call is
held back until it cannot be). It gives ``steps.ID.output`` (the answer), ``finish_reason``, ``model``,
``rounds`` and ``tool_calls``. Every call is a record of its own in the trace and the audit record (type
``tool``, under this step), sent live as the request's stage events (StageStarted/StageFinished, type ``tool``,
parent this step), and counted in ``inferline_tool_calls_total{tool, outcome}``.

A tool with ``require_approval`` (always, or ``{tools: [names]}``) pauses the request instead: when a round
proposes a call that needs approval, no call of that round runs; the step ends the request (finish reason
``approval_required``) and leaves its state in ``ctx.facts["approval_pending"]`` (the loop's turns, the
round, and each proposed call with an id), which the server keeps. The server resumes it by setting
``ctx.facts["approval_resume"]`` (that state and the client's decisions, by call id) on a new request of
the same pipeline: the step runs that round's calls (an approved one, or one that needs no approval) and
tells the model of each denied one as ``denied``, then goes on with the loop where it stopped (the rounds
count on). Whether a call needs approval is read from the step's tools as they are when it would run; an
approved call whose tool's definition is no longer the one it was proposed under is refused.

MCP tools are pinned: when the pipeline version is instantiated (at load and at each reload) the step lists
its servers' tools and keeps the SHA-256 of each allowed tool's schema with the version (in the database,
``tool_pins``: the first listing of a version holds across reloads, restarts and servers); a call to a tool
whose server now offers a different schema is refused until a new version of the pipeline is deployed, and a
tool that differs from its pin when the version is instantiated again is not offered at all (its new
description never reaches the model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, Field

from pipeline.context import RequestContext, Usage, chat_turns
from pipeline.errors import BackendError, StageError, StageTimeout
from pipeline.protocols import Catalog, ChatEngine, Resources
from pipeline.stage import CheckIssue, Stage, StageScope
from pipeline.template import Template
from pipeline.tracing import GEN_AI_REQUEST_MODEL
from stages import tools as functions
from stages.agent_calls import ProposedCall, ToolCaller, proposed_calls
from stages.agent_tools import (
    PIPELINE_PARAMETERS,
    BoundTool,
    HttpTool,
    McpTools,
    PipelineTool,
    ToolSpec,
    definition_sha256,
    sha256_of,
    spec_issues,
)
from stages.engines import engine_for
from stages.generate import _sampling
from stages.llm import ChatStepConfig, charge
from stages.stream import _Out, _text_of
from stages.text import IncrementalDetokenizer

logger = logging.getLogger(__name__)

#: Told to the model beside the functions: several calls in one reply run at the same time.
PARALLEL_NOTE = "To call several functions at once, reply with a JSON array of such objects."
#: The finish reason of a request paused for the client's approval of a tool call.
APPROVAL_REQUIRED = "approval_required"


class AgentConfig(ChatStepConfig):
    #: The tools the model may call.
    tools: list[ToolSpec] = Field(min_length=1)
    #: Model calls at most (each may propose tool calls); still calling after them fails the step.
    max_rounds: int = Field(4, ge=1, le=100)
    #: The whole loop's wall time.
    timeout_s: float = Field(60.0, gt=0, le=3600)
    #: One tool call's; a call past it is cancelled and told to the model as timed out.
    call_timeout_s: float = Field(10.0, gt=0, le=600)
    #: A tool result longer than this is cut before the model sees it.
    max_result_chars: int = Field(16000, ge=100, le=1_000_000)
    client_params: list[str] = Field(default_factory=lambda: ["max_tokens", "temperature", "top_p", "seed"])


@dataclass(slots=True)
class AgentOutputs:
    #: The answer.
    output: str
    finish_reason: str
    model: str
    #: Model calls made.
    rounds: int
    #: Tool calls made, whatever their outcome.
    tool_calls: int


class AgentStage(Stage):
    """A tool loop (see the module docstring)."""

    type_name = "agent"
    Config = AgentConfig
    Outputs = AgentOutputs
    is_model_call = True
    pauses_for_approval = True
    reads = frozenset({"input_messages"})

    def __init__(self, stage_id: str, config: BaseModel, resources: Resources):
        super().__init__(stage_id, config, resources)
        self._pins: asyncio.Task[list[BoundTool]] | None = None

    def start(self) -> None:
        """Pin the tools now, in the background, as the server starts serving the version (at its start, a
        reload, a deploy); a failure is logged, and the first request tries again. Unstarted (a pipeline built
        for one request), the first request pins them."""
        if self._pins is None and self.resources.tools is not None:
            self._pins = asyncio.ensure_future(self._pin())
            self._pins.add_done_callback(self._pin_failed)

    def _pin_failed(self, task: asyncio.Task[list[BoundTool]]) -> None:
        """Say why a version could not pin its tools as it loaded (its first request tries again)."""
        if not task.cancelled() and task.exception() is not None:
            logger.warning("agent step %s: cannot pin its tools at load: %s", self.id, task.exception())

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        from pipeline.context import FIELDS

        names = set().union(*(t.names for t in cast(AgentConfig, config).compiled.values()))
        return cls.reads | (names & FIELDS.keys())

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        config = cast(AgentConfig, config)
        issues = [*config.issues(catalog), *spec_issues(config.tools, catalog.mcp_servers, catalog.tool_headers)]
        if config.output is not None:
            issues.append((("output",), "an agent's answer is free text: remove output: (a later llm step can "
                                        "constrain it)"))
        if config.max_rounds > catalog.max_rounds:
            issues.append((("max_rounds",), f"at most {catalog.max_rounds} rounds (the server's "
                                            "workflows.max_rounds); write a smaller max_rounds"))
        return issues

    @classmethod
    def model_of(cls, config: BaseModel) -> str | None:
        return cast(AgentConfig, config).model

    @classmethod
    def calls(cls, config: BaseModel) -> list[tuple[tuple[str | int, ...], str]]:
        return [(("tools", i, "pipeline"), tool.pipeline.split("@", 1)[0])
                for i, tool in enumerate(cast(AgentConfig, config).tools) if isinstance(tool, PipelineTool)]

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {(key,): template for key, template in cast(AgentConfig, config).compiled.items()}

    async def reuse(self, ctx: RequestContext, scope: StageScope, outputs: dict[str, Any]) -> None:
        if scope.streams:  # a replay reuses the answer as it was sent, and runs no tool again
            text = str(outputs.get("output", ""))
            await scope.emit_text(text)
            ctx.output_text, ctx.finish_reason = text, str(outputs.get("finish_reason", "stop"))
            ctx.model = str(outputs.get("model", ctx.model))

    async def aclose(self) -> None:
        if self._pins is not None and not self._pins.done():
            self._pins.cancel()

    async def run(self, ctx: RequestContext, scope: StageScope) -> AgentOutputs:
        config = cast(AgentConfig, self.config)
        toolset = {tool.name: await self._with_arguments(tool) for tool in await self._pinned()}
        _list_mcp_tools(ctx, self.id, toolset.values())
        offered = [tool.offered() for tool in toolset.values()]
        system = f"{functions.preamble(offered, 'auto')} {PARALLEL_NOTE}"
        resumed = self._resumed(ctx)
        turns = list(resumed["turns"]) if resumed else chat_turns(config.messages(ctx, system))
        model, engine = await engine_for(self.resources, config.model or "")
        sampling = _sampling(config, ctx.params if scope.streams else {})
        scope.set_attribute(GEN_AI_REQUEST_MODEL, model)
        caller = ToolCaller(self.id, self.resources, ctx, config.call_timeout_s, config.max_result_chars,
                            scope.emit_step)
        usage, started = Usage(), time.perf_counter()
        try:
            async with asyncio.timeout(config.timeout_s):
                first = 1
                if resumed:
                    caller.made = int(resumed["made"])
                    calls = [ProposedCall(**call) for call in resumed["calls"]]
                    turns += await self._round(resumed["reply"], calls, toolset, caller, int(resumed["round"]),
                                               ctx.facts["approval_resume"]["decisions"])
                    first = int(resumed["round"]) + 1
                return await self._loop(ctx, scope, config, engine, turns, sampling, model, toolset, caller, usage,
                                        started, first)
        except TimeoutError:
            raise StageTimeout(self.id, f"the tool loop ran past its timeout_s ({config.timeout_s:g} s) after "
                                        f"{caller.made} tool call(s)") from None

    async def _loop(self, ctx: RequestContext, scope: StageScope, config: AgentConfig, engine: Any,
                    turns: list[dict[str, str]], sampling: Any, model: str, toolset: dict[str, BoundTool],
                    caller: ToolCaller, usage: Usage, started: float, first: int) -> AgentOutputs:
        """Ask, run what the model proposes, feed the results back; until it answers, a call needs approval,
        or max_rounds."""
        for round_ in range(first, config.max_rounds + 1):
            out = _Out(ctx.output_filter if scope.streams else None, scope, held=not scope.streams)
            text, finish = await self._generate(engine, turns, sampling, out, usage, ctx)
            proposed = proposed_calls(text)
            if proposed is None:
                return self._answer(ctx, scope, engine, sampling, model, text, finish, out,
                                    round_, caller.made, usage, started)
            if round_ == config.max_rounds:
                break
            calls = [ProposedCall(f"mcpr_{ctx.request_id[:24]}_{round_}_{i}", name, args,
                                  toolset[name].schema_sha256 if name in toolset else "")
                     for i, (name, args) in enumerate(proposed)]
            if any(_needs_approval(toolset, call) for call in calls):
                return await self._pause(ctx, scope, model, text, turns, calls, toolset, caller, round_, usage,
                                         started)
            turns += await self._round(text, calls, toolset, caller, round_, {})
        self._account(model, usage, time.perf_counter() - started, scope)
        raise StageError(self.id, f"the model still called tools after max_rounds ({config.max_rounds}) model "
                                  "calls; raise max_rounds or tell the model to answer sooner")

    @staticmethod
    async def _round(reply: str, calls: list[ProposedCall], toolset: dict[str, BoundTool], caller: ToolCaller,
                     round_: int, decisions: dict[str, bool]) -> list[dict[str, str]]:
        """Run one round's calls at the same time (a call that needs approval only when *decisions* approve it;
        otherwise it is denied): the model's reply and the results, as the next two turns."""
        def run(call: ProposedCall) -> Awaitable[str]:
            tool = toolset.get(call.name)
            if not _needs_approval(toolset, call):
                return caller.call(tool, call.name, call.arguments, round_)
            if decisions.get(call.id):
                return caller.call(tool, call.name, call.arguments, round_, approved=call)
            return caller.deny(tool, call, round_)

        results = await asyncio.gather(*(run(call) for call in calls))
        return [{"role": "assistant", "content": reply},
                {"role": "user", "content": "\n".join(functions.result_text(r) for r in results)}]

    async def _pause(self, ctx: RequestContext, scope: StageScope, model: str, reply: str,
                     turns: list[dict[str, str]], calls: list[ProposedCall], toolset: dict[str, BoundTool],
                     caller: ToolCaller, round_: int, usage: Usage, started: float) -> AgentOutputs:
        """End the request with the round's calls waiting for approval, its state kept by the server's
        ``approval_keeper`` (see the module docstring)."""
        self._account(model, usage, time.perf_counter() - started, scope)
        ctx.usage = Usage(ctx.usage.input_tokens + usage.input_tokens, ctx.usage.output_tokens + usage.output_tokens)
        for call in calls:
            if _needs_approval(toolset, call):
                caller.pend(toolset[call.name], call, round_)
        ctx.facts["approval_pending"] = {
            "step": self.id, "round": round_, "turns": turns, "reply": reply, "made": caller.made,
            "calls": [call.as_json() for call in calls], "reuse": _reusable(ctx, self.id),
            "requests": [{"id": call.id, "name": call.name, "server_label": toolset[call.name].server or
                          toolset[call.name].kind, "arguments": call.arguments}
                         for call in calls if _needs_approval(toolset, call)]}
        if (keeper := ctx.facts.get("approval_keeper")) is not None:
            await keeper(ctx)
        if scope.streams:
            ctx.model, ctx.output_text, ctx.finish_reason = model, "", APPROVAL_REQUIRED
        scope.end_request()
        return AgentOutputs("", APPROVAL_REQUIRED, model, round_, caller.made)

    def _resumed(self, ctx: RequestContext) -> dict[str, Any] | None:
        """The paused state this request resumes, when it is this step's."""
        resume = ctx.facts.get("approval_resume")
        return resume["state"] if resume is not None and resume["state"].get("step") == self.id else None

    def _answer(self, ctx: RequestContext, scope: StageScope, engine: Any, sampling: Any, model: str, text: str,
                finish: str, out: _Out, rounds: int, made: int, usage: Usage, started: float) -> AgentOutputs:
        self._account(model, usage, time.perf_counter() - started, scope)
        ctx.usage = Usage(ctx.usage.input_tokens + usage.input_tokens, ctx.usage.output_tokens + usage.output_tokens)
        answer = "".join(out.parts) if scope.streams else text
        if scope.streams:
            ctx.model, ctx.output_text, ctx.finish_reason = model, answer, finish
            ctx.facts["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                     "max_tokens": sampling.max_tokens, "seed": sampling.seed}
            ctx.facts["weights_hash"] = engine.weights_hash
        return AgentOutputs(answer, finish, model, rounds, made)

    async def _generate(self, engine: Any, turns: list[dict[str, str]], sampling: Any, out: _Out, usage: Usage,
                        ctx: RequestContext) -> tuple[str, str]:
        """One model call: its text and finish reason. Text goes out through *out* once it cannot be a call."""
        if isinstance(engine, ChatEngine):
            stream, prompt_ids = await engine.submit_messages(turns, sampling), []
        else:
            prompt_ids = engine.tokenizer.encode_chat(turns)
            stream = await engine.submit(prompt_ids, sampling)
        detokenizer = IncrementalDetokenizer(engine.tokenizer.decode, prompt_ids)
        parts: list[str] = []
        ids: list[int] = []
        sending, finish = False, "stop"
        before_in, before_out = usage.input_tokens, usage.output_tokens
        try:
            async for event in stream:
                piece = _text_of(event, detokenizer, ids)
                if event.finish_reason is not None:
                    piece += detokenizer.flush()
                    finish = event.finish_reason
                parts.append(piece)
                usage.input_tokens = before_in + event.num_prompt_tokens
                usage.output_tokens = before_out + event.num_output_tokens
                if sending:
                    blocked = await out.send(piece)
                elif not _may_be_calls("".join(parts)):
                    sending, blocked = True, await out.send("".join(parts))
                else:
                    blocked = None
                if blocked:
                    return "".join(parts), blocked
                if event.finish_reason is not None:
                    break
        finally:
            await stream.aclose()
        text = "".join(parts)
        if proposed_calls(text) is None:  # the answer: what was held back goes out now
            blocked = await out.send("" if sending else text, final=True)
            finish = blocked or finish
        return text, finish

    async def _with_arguments(self, tool: BoundTool) -> BoundTool:
        """*tool*, a pipeline tool with its callee's arguments as they are now: ``input``, ``tags`` and the sampling
        options the callee lets callers set (the callee not served now: ``input`` alone, and the call says so)."""
        caller = self.resources.pipelines
        if not isinstance(tool.spec, PipelineTool) or caller is None:
            return tool
        name, _, version = tool.spec.pipeline.partition("@")
        try:
            schema = await caller.tool_schema(name, version or None)
        except BackendError:
            return tool
        return dataclasses.replace(tool, parameters=dict(schema))

    async def _pinned(self) -> list[BoundTool]:
        """The tools, MCP ones pinned; a pin that failed (a server down at load) is tried again."""
        if self._pins is None or (self._pins.done() and self._pins.exception() is not None):
            self._pins = asyncio.ensure_future(self._pin())
        return await asyncio.shield(self._pins)

    async def _pin(self) -> list[BoundTool]:
        bound: list[BoundTool] = []
        for spec in cast(AgentConfig, self.config).tools:
            if isinstance(spec, HttpTool):
                bound.append(BoundTool(spec.name, "http", spec.description, spec.parameters,
                                       definition_sha256(spec), spec))
            elif isinstance(spec, PipelineTool):
                bound.append(BoundTool(spec.name, "pipeline", spec.description, PIPELINE_PARAMETERS,
                                       definition_sha256(spec), spec))
            else:
                bound += await self._pin_mcp(spec)
        return bound

    async def _pin_mcp(self, spec: McpTools) -> list[BoundTool]:
        if self.resources.tools is None:
            raise BackendError("this process runs no tools: an agent step runs under `inferline serve` or "
                               "`inferline run`")
        listed = await self.resources.tools.list_mcp(spec.server)
        missing = [name for name in spec.allow if name not in listed]
        if missing:
            raise BackendError(f"MCP server {spec.server!r} offers no tool {', '.join(map(repr, missing))} "
                               f"(it offers: {', '.join(sorted(listed)) or 'none'})")
        allow_sha = sha256_of(sorted(spec.allow))
        keys = {name: f"{self.id}/{spec.server}/{name}" for name in spec.allow}
        pipeline, spec_sha256 = self.version
        pinned = {keys[name]: listed[name].sha256 for name in spec.allow}
        if spec_sha256:  # a kept version: the definitions it first listed hold, across reloads and restarts
            pinned = dict(await self.resources.tools.pin(pipeline, spec_sha256, pinned))
        # A tool whose server now offers another definition than the pinned one is not offered: its new
        # description would reach the model (where a poisoned tool puts its instructions); a call is refused.
        if drifted := sorted(name for name in spec.allow if listed[name].sha256 != pinned[keys[name]]):
            logger.warning("agent step %s: MCP server %r changed %s since this pipeline version pinned them: not "
                           "offered until a new version is deployed", self.id, spec.server, ", ".join(drifted))
        return [BoundTool(name, "mcp", listed[name].description, dict(listed[name].parameters),
                          pinned[keys[name]], spec, spec.server, allow_sha) for name in spec.allow
                if name not in drifted]

    def _account(self, model: str, usage: Usage, seconds: float, scope: StageScope) -> None:
        charge(self.resources.catalog, model, usage, seconds, scope)


def _reusable(ctx: RequestContext, step: str) -> dict[str, dict[str, Any]]:
    """The outputs of the steps that ran before this one (in a pipeline that keeps them: one that audits), which
    the resumed request reuses where the step and what it reads are unchanged (as a replay by step does)."""
    return {record.key: {"definition_sha256": record.definition_sha256, "inputs_sha256": record.inputs_sha256,
                         "output": record.output}
            for record in ctx.stages if record.output is not None and record.status == "ok" and not record.parent
            and record.id != step}


def _list_mcp_tools(ctx: RequestContext, step: str, tools: Iterable[BoundTool]) -> None:
    """Say which MCP tools the step offers its model, by server (``ctx.facts["tools_listed"]``)."""
    by_server: dict[str, list[dict[str, Any]]] = {}
    for tool in tools:
        if tool.kind == "mcp":
            by_server.setdefault(tool.server, []).append({"name": tool.name, "description": tool.description,
                                                          "input_schema": tool.parameters})
    ctx.facts.setdefault("tools_listed", []).extend(
        {"step": step, "server": server, "tools": listed} for server, listed in by_server.items())


def _needs_approval(toolset: dict[str, BoundTool], call: ProposedCall) -> bool:
    tool = toolset.get(call.name)
    return tool is not None and tool.needs_approval


def _may_be_calls(prefix: str) -> bool:
    """Whether a reply starting with *prefix* may still be calls: one (stages/tools.py) or a JSON array of them."""
    return functions.could_be_call(prefix) or prefix.lstrip().startswith("[")
