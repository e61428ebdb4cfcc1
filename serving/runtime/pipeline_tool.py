"""A served pipeline as a tool: the arguments it takes, as ``POST /pipelines/{name}`` takes its body.

    schema = input_schema(pipeline)     # {"properties": {"input": ..., "tags": ..., "temperature": ...}, ...}
    ToolArguments.model_validate({"input": "How do I reset my password?", "temperature": 0})

What ``/mcp`` lists for each pipeline (serving/http/mcp_routes.py) and what an ``agent`` step's ``pipeline`` tools
offer their model (:meth:`serving.runtime.calls.LocalPipelines.tool_schema`): ``input`` (one user message: what a
model calling a tool gives), ``tags``, and the sampling options the pipeline lets callers set; no ``stream`` (a
tool's result comes whole).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.context import ChatMessage
from pipeline.runner import Pipeline


class GenerationParams(BaseModel):
    """Sampling overrides a caller may send; each pipeline decides which it accepts."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's request extensions, which benchmark and evaluation tools send.
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = Field(None, description="Generate past the end-of-sequence token, up to max_tokens.")
    min_tokens: int | None = Field(None, ge=0, le=1_000_000,
                                   description="No end-of-sequence or stop token before this many output tokens.")
    output: dict[str, Any] | None = Field(
        None, description='Constrained decoding: {"json_schema": {...}}, {"regex": "..."} or {"choice": [...]}.')

    def overrides(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, include=set(GenerationParams.model_fields))


class ToolArguments(GenerationParams):
    """A pipeline's arguments as a tool: ``POST /pipelines/{name}``'s body with ``input`` and no ``stream``."""

    input: str = Field(description="The user message the pipeline answers.")
    tags: dict[str, str] = Field(default_factory=dict, description="Free-form tags, visible to `when:` and audit.")

    def chat(self) -> list[ChatMessage]:
        return [ChatMessage("user", self.input)]


#: Every argument a pipeline tool may take; each tool's schema keeps the sampling options its pipeline lets
#: callers set (:func:`input_schema`).
TOOL_ARGUMENTS: dict[str, Any] = ToolArguments.model_json_schema()
_ALWAYS = ("input", "tags")


def input_schema(pipeline: Pipeline) -> dict[str, Any]:
    """Pipeline *pipeline*'s arguments: ``input``, ``tags``, and the sampling options its answering model step
    lets callers set (``client_params``); a model offered the tool is offered no option the pipeline refuses."""
    lists = [(bound.plan.spec.id, params) for bound in pipeline.stages
             if isinstance(params := getattr(bound.plan.config, "client_params", None), list)]
    # A workflow: its answering step's list (the others take no caller options); a chain: its generate stage's.
    answering = [params for step, params in lists if step in pipeline.answer_steps]
    accepted = {name for params in (answering or [params for _, params in lists]) for name in params}
    properties = TOOL_ARGUMENTS["properties"]
    return {**TOOL_ARGUMENTS, "properties": {name: schema for name, schema in properties.items()
                                             if name in accepted or name in _ALWAYS}}
