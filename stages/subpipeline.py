"""The ``pipeline`` step: runs another served pipeline as a part of this request, a sub-pipeline.

YAML::

    - id: triaged
      type: pipeline
      with:
        pipeline: triage@2             # a served pipeline, at a version (its label or 6+ characters of its spec hash)
        input: "{{ input }}"           # the callee's input (a template; the default)
        tags: {tier: "{{ tags.tier }}"}  # the callee's tags (templates); the caller's are not passed on

It gives ``steps.ID.output`` (the callee's answer), ``finish_reason`` and ``status``; when it answers the
request (it is a model call as the ``llm`` step is: the last one no step reads answers), the callee's text
streams to the client as it comes. The callee's access roles
apply to the caller's key (a key the callee refuses fails the step as a denial); its steps nest under this one
in the trace and in the caller's audit record, where its costs and tokens count too; its own audit step writes
no record. A pipeline that calls itself, directly or through others, does not load (the server checks the
calls between its pipeline files together).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import cast

from pydantic import BaseModel, Field

from pipeline.context import FIELDS, ChatMessage, RequestContext, StageRecord
from pipeline.errors import BackendError, InferlineError, PolicyDenied
from pipeline.protocols import Catalog
from pipeline.spec import NAME_PATTERN
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.template import Template, compile_template
from stages.prompt import template_issues

#: ``name`` or ``name@version``.
CALLEE_PATTERN = NAME_PATTERN.removesuffix("$") + r"(@[A-Za-z0-9._-]+)?$"


class PipelineStepConfig(NoConfig):
    #: The served pipeline to run: ``name`` or ``name@version``.
    pipeline: str = Field(pattern=CALLEE_PATTERN)
    #: The callee's input (a template over this request's fields and earlier steps' outputs).
    input: str = "{{ input }}"
    #: The callee's tags, by name (templates).
    tags: dict[str, str] = Field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.pipeline.split("@", 1)[0]

    @property
    def version(self) -> str | None:
        return self.pipeline.split("@", 1)[1] if "@" in self.pipeline else None

    @cached_property
    def compiled(self) -> dict[str, Template]:
        return {"input": compile_template(self.input)} | {
            f"tags.{name}": compile_template(text) for name, text in self.tags.items()}


@dataclass(slots=True)
class PipelineStepOutputs:
    #: The callee's answer.
    output: str
    finish_reason: str
    #: ok | denied | failed | cancelled: how the callee's request ended.
    status: str


class PipelineStep(Stage):
    """A sub-pipeline (see the module docstring)."""

    type_name = "pipeline"
    Config = PipelineStepConfig
    Outputs = PipelineStepOutputs
    #: The callee's answer may be this request's: it streams it as it comes.
    is_model_call = True

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        names = set().union(*(t.names for t in cast(PipelineStepConfig, config).compiled.values()))
        return frozenset(names & FIELDS.keys())

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        return [(_where(loc), message) for loc, message, *_ in
                template_issues(lambda: cast(PipelineStepConfig, config).compiled)]

    @classmethod
    def calls(cls, config: BaseModel) -> list[tuple[tuple[str | int, ...], str]]:
        return [(("pipeline",), cast(PipelineStepConfig, config).name)]

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {_where((key,)): template for key, template in cast(PipelineStepConfig, config).compiled.items()}

    async def run(self, ctx: RequestContext, scope: StageScope) -> PipelineStepOutputs:
        config = cast(PipelineStepConfig, self.config)
        caller = self.resources.pipelines
        if caller is None:
            raise BackendError("this process runs no other pipelines: a pipeline step runs under `inferline serve` "
                               "or `inferline run`")
        values = {name: ctx.field_value(name) for template in config.compiled.values() for name in template.names}
        rendered = {key: template.render(values).strip() for key, template in config.compiled.items()}
        child = RequestContext(config.name, [ChatMessage("user", rendered.pop("input"))], principal=ctx.principal,
                               tags={key.removeprefix("tags."): value for key, value in rendered.items()},
                               operation=ctx.operation, client_addr=ctx.client_addr, parent_request=ctx.request_id)
        final = await caller.call_nested(config.name, config.version, child, scope.emit_text, scope.emit_step)
        self._fold(ctx, scope, child)
        error = getattr(final, "message", "")
        if child.status == "denied" and isinstance(child.error, PolicyDenied):
            raise child.error
        if child.status != "ok":
            raise BackendError(f"pipeline {config.pipeline!r} {child.status}: {error}") if not isinstance(
                child.error, InferlineError) else child.error
        if scope.streams:  # the callee's answer is this request's
            ctx.output_text, ctx.finish_reason, ctx.model = child.output_text, child.finish_reason, child.model
            ctx.documents = child.documents
        return PipelineStepOutputs(child.output_text, child.finish_reason, child.status)

    def _fold(self, ctx: RequestContext, scope: StageScope, child: RequestContext) -> None:
        """The callee's steps under this one (its records, its cost and tokens in the caller's)."""
        since = (child.received_at - ctx.received_at).total_seconds()  # its records' times: from its own start
        ctx.stages += [dataclasses.replace(record, parent=_nested(self.id, record), started_s=record.started_s + since)
                       for record in child.stages]
        for entry in child.ledger.entries:
            scope.add_cost(entry.usd, entry.kind, f"{child.pipeline}/{entry.stage_id}: {entry.detail}".rstrip(": "))
        scope.add_tokens(child.usage.input_tokens, child.usage.output_tokens)
        ctx.usage.input_tokens += child.usage.input_tokens
        ctx.usage.output_tokens += child.usage.output_tokens


def _nested(step_id: str, record: StageRecord) -> str:
    return f"{step_id}/{record.parent}" if record.parent else step_id


def _where(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """``tags.tier`` -> ("tags", "tier"): the place of a template in ``with:``."""
    key = str(loc[0]) if loc else ""
    return ("tags", key.removeprefix("tags."), *loc[1:]) if key.startswith("tags.") else loc
