"""The ``reply`` step: answers the request with a fixed text and ends it, e.g. at the end of a branch.

YAML::

    - id: escalate
      type: reply
      when: "steps.classify.output.intent == 'refund' and steps.classify.output.amount > 500"
      with:
        text: "A refund of this size goes to a person: we have passed your request on and will write within a day."

The text is a template over the request's fields and the outputs of the steps before it. It goes to the client
as the answer (finish reason ``stop``) and the request ends: the steps after it are skipped (reason ``ended``),
but ``always`` ones (the audit) still run. It gives ``steps.ID.text``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from pydantic import BaseModel, Field

from pipeline.context import FIELDS, RequestContext
from pipeline.protocols import Catalog
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.template import Template, compile_template
from stages.prompt import template_issues


class ReplyConfig(NoConfig):
    #: The answer (a template).
    text: str = Field(min_length=1)

    @cached_property
    def compiled(self) -> Template:
        return compile_template(self.text)


@dataclass(slots=True)
class ReplyOutputs:
    #: The answer as sent.
    text: str


class ReplyStage(Stage):
    """Sends a fixed answer and ends the request (see the module docstring)."""

    type_name = "reply"
    Config = ReplyConfig
    Outputs = ReplyOutputs
    sends_answer = True

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        return cast(ReplyConfig, config).compiled.names & FIELDS.keys()

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        return [(("text", *loc[1:]), message) for loc, message, *_ in
                template_issues(lambda: {"text": cast(ReplyConfig, config).compiled})]

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {("text",): cast(ReplyConfig, config).compiled}

    async def reuse(self, ctx: RequestContext, scope: StageScope, outputs: dict[str, Any]) -> None:
        text = str(outputs.get("text", ""))
        await scope.emit_text(text)
        ctx.output_text, ctx.finish_reason = text, "stop"
        scope.end_request()

    async def run(self, ctx: RequestContext, scope: StageScope) -> ReplyOutputs:
        template = cast(ReplyConfig, self.config).compiled
        text = template.render({name: ctx.field_value(name) for name in template.names}).strip()
        await scope.emit_text(text)
        ctx.output_text, ctx.finish_reason = text, "stop"
        scope.end_request()
        return ReplyOutputs(text)
