"""The ``llm`` step: one model call of a workflow, from its own prompt to its own output.

YAML::

    - id: classify
      type: llm
      with:
        model: smol                      # default: the server's first model
        system: "Classify the request."  # templates over the request's fields and earlier steps' outputs
        user: "{{ input }}"              # the default
        history: false                   # the client's earlier turns before the user message (default: false)
        documents: [kb, web]             # steps whose documents join the prompt as numbered sources [n]
        max_tokens: 64
        temperature: 0
        stop: ["\\n\\n"]
        output:                          # constrained decoding: json_schema, regex or choice
          json_schema: {type: object, properties: {intent: {enum: [refund, tech, other]}}, required: [intent]}

It gives ``steps.ID.output`` (the text, or with ``output: json_schema`` the parsed object, typed by the schema at
load: ``steps.classify.output.intent`` is one of 'refund', 'tech', 'other'), ``text``, ``finish_reason``,
``model``, ``input_tokens`` and ``output_tokens``. An output that does not match its constraint fails the step
with ``invalid_output`` (a ``retry:`` with that ``on:`` runs it again). A pipeline may call models any number
of times; steps that do not need each other call at the same time, and the engine batches them.

The answering step (``stream: true``, or the pipeline's last ``llm`` step when it has no ``stream`` stage)
sends its text to the client as it comes, through the policy's output rails when there are any, and its
output, finish reason and documents are the response's; the callers' sampling options
(``client_params``) apply to it only. Every step's tokens count in the request's usage and cost.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from pydantic import BaseModel, Field

from pipeline.context import ChatMessage, Document, RequestContext, Usage, chat_turns
from pipeline.errors import InvalidOutput
from pipeline.protocols import Catalog, ChatEngine, SchedulingHints, TokenStream
from pipeline.refs import ModelRef
from pipeline.stage import CheckIssue, Stage, StageScope
from pipeline.template import Template, compile_template
from pipeline.tracing import GEN_AI_REQUEST_MODEL, GEN_AI_USAGE_INPUT_TOKENS, GEN_AI_USAGE_OUTPUT_TOKENS
from pipeline.types import ValueType
from stages.engines import engine_for
from stages.generate import GenerateConfig, OutputSpec, _sampling, output_issues
from stages.prompt import sources_block, template_issues
from stages.stream import _Out, _text_of, check_output
from stages.text import IncrementalDetokenizer, StopStrings


class ChatStepConfig(GenerateConfig):
    """What a step that builds its own chat prompt takes (``llm``, ``agent``): its model, its system and user
    message templates, and whether the client's earlier turns go between them."""

    #: The model (default: the server's first).
    model: ModelRef | None = None
    #: The system message template; none when left out.
    system: str | None = None
    #: The user message template.
    user: str = "{{ input }}"
    #: Put the client's earlier turns before the user message.
    history: bool = False

    @cached_property
    def compiled(self) -> dict[str, Template]:
        sources = {"user": self.user} if self.system is None else {"system": self.system, "user": self.user}
        return {key: compile_template(text) for key, text in sources.items()}

    def messages(self, ctx: RequestContext, more_system: str = "") -> list[ChatMessage]:
        """The prompt for *ctx*: the system message (rendered, then *more_system*; none when both are empty), the
        earlier turns with ``history``, the user message."""
        values = {name: ctx.field_value(name) for template in self.compiled.values() for name in template.names}
        system = self.compiled.get("system")
        system_text = system.render(values).strip() if system is not None else ""
        if more_system:
            system_text = f"{system_text}\n\n{more_system}" if system_text else more_system
        messages = [ChatMessage("system", system_text)] if system_text else []
        if self.history:
            messages += earlier_turns(ctx)
        messages.append(ChatMessage("user", self.compiled["user"].render(values).strip()))
        return messages

    def issues(self, catalog: Catalog) -> list[CheckIssue]:
        """Its templates' load errors, and a missing model."""
        issues = template_issues(lambda: self.compiled)
        if self.model is None and not catalog.models:
            issues.append(((), "no model to call: inferline.yaml has no models; add one, or set model:"))
        return issues


class LlmConfig(ChatStepConfig):
    #: Steps whose ``documents`` (a retrieve step's) join the prompt as numbered sources, in this order.
    documents: list[str] = Field(default_factory=list)
    #: The line above the documents in the system message.
    sources_heading: str = "Answer from these numbered sources and cite them as [n]:"
    #: Stop strings (not part of the output).
    stop: list[str] = Field(default_factory=list)
    #: Constrained decoding: exactly one of json_schema, regex or choice.
    output: OutputSpec | None = None  # type: ignore[assignment]  # a step's own: no caller may replace it
    #: The sampling options a caller may set, on the answering step only (``max_tokens`` never above this one's).
    client_params: list[str] = Field(
        default_factory=lambda: ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"])



@dataclass(slots=True)
class LlmOutputs:
    #: The text, or the object its ``output: json_schema`` describes.
    output: Any
    text: str
    finish_reason: str
    model: str
    input_tokens: int
    output_tokens: int


class LlmStage(Stage):
    """One model call with its own prompt and output, readable by later steps (see the module docstring)."""

    type_name = "llm"
    Config = LlmConfig
    Outputs = LlmOutputs
    is_model_call = True
    reads = frozenset({"input_messages"})

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        from pipeline.context import FIELDS

        names = set().union(*(t.names for t in cast(LlmConfig, config).compiled.values()))
        return cls.reads | (names & FIELDS.keys())

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        config = cast(LlmConfig, config)
        return config.issues(catalog) + (output_issues(config.output, catalog) if config.output is not None else [])

    @classmethod
    def model_of(cls, config: BaseModel) -> str | None:
        return cast(LlmConfig, config).model

    @classmethod
    def output_types(cls, config: BaseModel) -> dict[str, ValueType]:
        types = super().output_types(config)
        output = cast(LlmConfig, config).output
        if output is not None and output.json_schema is not None:
            types["output"] = ValueType.from_schema(output.json_schema)
        elif output is not None and output.choice is not None:
            types["output"] = ValueType(frozenset({"string"}), values=tuple(output.choice), name="choice")
        else:
            types["output"] = ValueType.of(str)
        return types

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {(key,): template for key, template in cast(LlmConfig, config).compiled.items()}

    @classmethod
    def step_reads(cls, config: BaseModel) -> list[tuple[tuple[str | int, ...], str, str]]:
        return [(("documents", n), step, "documents") for n, step in enumerate(cast(LlmConfig, config).documents)]

    async def run(self, ctx: RequestContext, scope: StageScope) -> LlmOutputs:
        config = cast(LlmConfig, self.config)
        documents = [doc for step in config.documents for doc in ctx.steps.get(step, {}).get("documents") or ()]
        turns = chat_turns(self._messages(ctx, config, documents))
        model, engine = await engine_for(self.resources, config.model or "")
        # The callers' sampling options are the answer's: the steps before it are the pipeline's own.
        sampling = _sampling(config, ctx.params if scope.streams else {})
        scope.set_attribute(GEN_AI_REQUEST_MODEL, model)
        started = time.perf_counter()
        salt = ctx.tenant if config.isolate_tenants else ""
        if isinstance(engine, ChatEngine):
            stream, prompt_ids = await engine.submit_messages(turns, sampling, cache_salt=salt), []
        else:
            prompt_ids = engine.tokenizer.encode_chat(turns)
            deadline_s = None if config.queue_timeout_ms is None else started + config.queue_timeout_ms / 1000
            stream = await engine.submit(prompt_ids, sampling, cache_salt=salt,
                                         hints=SchedulingHints(config.priority, ctx.tenant, deadline_s))
        detokenizer = IncrementalDetokenizer(engine.tokenizer.decode, prompt_ids)
        out = _Out(ctx.output_filter if scope.streams else None, scope, held=scope.holds_text)
        usage = Usage()
        finish = await _read(stream, detokenizer, StopStrings(config.stop), out, usage)
        text = "".join(out.parts)
        self._account(model, usage, time.perf_counter() - started, scope)
        ctx.usage = Usage(ctx.usage.input_tokens + usage.input_tokens, ctx.usage.output_tokens + usage.output_tokens)
        outputs = LlmOutputs(_parsed(text, finish, config), text, finish, model, usage.input_tokens,
                             usage.output_tokens)
        if scope.streams:  # the response's answer, sent now if it waited for its check
            if scope.holds_text:
                await scope.emit_text(text)
            ctx.model, ctx.output_text, ctx.finish_reason = model, text, finish
            # The sampling it ran, as the audit record keeps generate's (what a replay sends again).
            ctx.facts["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                     "max_tokens": sampling.max_tokens, "seed": sampling.seed}
            ctx.facts["weights_hash"] = engine.weights_hash
            if documents:
                ctx.documents = documents
        return outputs

    async def reuse(self, ctx: RequestContext, scope: StageScope, outputs: dict[str, Any]) -> None:
        if scope.streams:  # the answer, as it was sent
            text = str(outputs.get("text", ""))
            await scope.emit_text(text)
            ctx.output_text, ctx.finish_reason = text, str(outputs.get("finish_reason", "stop"))
            ctx.model = str(outputs.get("model", ctx.model))

    def prompt(self, ctx: RequestContext) -> list[ChatMessage] | None:
        return self._messages(ctx, cast(LlmConfig, self.config), [])

    def _messages(self, ctx: RequestContext, config: LlmConfig, documents: list[Document]) -> list[ChatMessage]:
        return config.messages(ctx, sources_block(config.sources_heading, documents) if documents else "")

    def _account(self, model: str, usage: Usage, seconds: float, scope: StageScope) -> None:
        charge(self.resources.catalog, model, usage, seconds, scope)
        scope.set_attribute(GEN_AI_USAGE_INPUT_TOKENS, usage.input_tokens)
        scope.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, usage.output_tokens)


async def _read(stream: TokenStream, detokenizer: IncrementalDetokenizer, stops: StopStrings, out: _Out,
                usage: Usage) -> str:
    """Read *stream* to its end (or a stop string, or the rails' block) into *out*; the finish reason."""
    ids: list[int] = []
    try:
        async for event in stream:
            usage.input_tokens, usage.output_tokens = event.num_prompt_tokens, event.num_output_tokens
            text, hit = stops.feed(_text_of(event, detokenizer, ids))
            if hit:
                return await out.send(text, final=True) or "stop"
            if blocked := await out.send(text):
                return blocked
            if event.finish_reason is not None:
                tail, hit = stops.feed(detokenizer.flush())
                tail += "" if hit else stops.flush()
                return await out.send(tail, final=True) or ("stop" if hit else event.finish_reason)
        return await out.send(stops.flush(), final=True) or "stop"
    finally:
        await stream.aclose()  # leaving early (a stop string, a block, a cancellation) aborts it in the engine


def earlier_turns(ctx: RequestContext) -> list[ChatMessage]:
    """The conversation before the client's last user turn, its system messages left out (``history: true``)."""
    last = max((i for i, m in enumerate(ctx.input_messages) if m.role == "user"), default=0)
    return [ChatMessage(m.role, m.content) for m in ctx.input_messages[:last] if m.role != "system"]


def charge(catalog: Catalog, model: str, usage: Usage, seconds: float, scope: StageScope) -> None:
    """A model call's tokens and compute time into the step's cost (at *model*'s price) and token counts."""
    info = catalog.models.get(model)
    if info is not None:
        scope.add_cost(info.price.tokens_usd(usage.input_tokens, usage.output_tokens), "tokens",
                       f"{model}: {usage.input_tokens} in, {usage.output_tokens} out")
        scope.add_cost(info.price.compute_usd(seconds), "compute", f"{model}: {seconds:.3f} s")
    scope.add_tokens(usage.input_tokens, usage.output_tokens)


def _parsed(text: str, finish: str, config: LlmConfig) -> Any:
    """The step's ``output``: *text*, or the object it holds under ``output: json_schema``; InvalidOutput when
    it does not match its constraint."""
    if config.output is None:
        return text
    constraint = config.output.as_dict()
    error = check_output(text, constraint)
    if error is None and finish != "stop":
        error = f"incomplete: generation ended with finish reason {finish!r} (raise max_tokens)"
    if error is not None:
        raise InvalidOutput(f"the output does not match its {next(iter(constraint))}: {error}")
    return json.loads(text) if config.output.json_schema is not None else text
