"""Pydantic models of a pipeline file, and the ``Strict`` base every spec model builds on.

These are plain schemas (``extra="forbid"`` everywhere, so a typo is an error,
not a silently ignored key). Loading with located errors lives in
:mod:`pipeline.loader`; what each stage's ``with:`` accepts is that stage's own
``Config`` model. The server's own settings are not the core's: what a pipeline
may name of them reaches it as a :class:`~pipeline.protocols.Catalog`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pipeline.diagnostics import suggest

_NAME = r"^[a-z][a-z0-9_-]*$"
#: Names of pipelines, stages and indexes (an index name is also a folder name: never a path).
NAME_PATTERN = _NAME
#: The longest pipeline name: it is a file name (``<name>.yaml``, and the deploy's temporary file beside it)
#: and the audit log's ``pipeline`` column (200 characters).
MAX_PIPELINE_NAME = 128
#: What a pipeline name may be, for those that check one before it names a file (the deploy API).
PIPELINE_NAME_RULE = f"lowercase letters, digits, '-' and '_', starting with a letter, at most {MAX_PIPELINE_NAME}"


def is_pipeline_name(name: str) -> bool:
    """Whether *name* may name a pipeline (``PipelineSpec.name``): never a path, a control or non-ASCII character."""
    return len(name) <= MAX_PIPELINE_NAME and re.fullmatch(_NAME, name) is not None


class Strict(BaseModel):
    """Base of every spec model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


#: What a step's ``retry:`` may retry on: a failure, a timeout, an output its constraint refuses, an empty one.
RETRY_ON = ("error", "timeout", "invalid_output", "empty")


class RetrySpec(Strict):
    """Attempts of one step, owned by the runner (pipeline/runner.py); each attempt is in the trace and the audit
    record, and a step whose text streams to the client is retried only before its first token."""

    #: How many times the step runs at most, the first time included (2: one retry).
    attempts: int = Field(2, ge=1, le=10)
    #: The wait before the second attempt; it doubles for each one after.
    backoff_ms: int = Field(0, ge=0, le=60_000)
    #: What is retried: error (a failure), timeout (timeout_s), invalid_output (an output its constraint or
    #: schema refuses), empty (no text). Default: all four.
    on: list[Literal["error", "timeout", "invalid_output", "empty"]] = Field(
        default_factory=lambda: list(RETRY_ON), min_length=1)


class RepeatSpec(Strict):
    """A bounded loop: the steps from ``from`` to this one run again, round after round, until ``until`` holds
    (checked after each round) or ``max`` rounds have run."""

    #: The loop's first step (an ancestor of this one); the loop is every step from it to this one.
    from_: str = Field(alias="from", pattern=_NAME)
    #: The loop ends when this holds, e.g. ``steps.check.output.passed``: it reads what the loop's steps give.
    until: str
    #: The most rounds; required, and at most the server's ``workflows.max_rounds``.
    max: int = Field(ge=1)


class StageSpec(Strict):
    """One entry of a pipeline's ``stages:`` list: a step of its graph (pipeline/graph.py)."""

    #: Unique within the pipeline: lowercase letters, digits, '-' and '_'.
    id: str = Field(pattern=_NAME)
    #: A registered stage type.
    type: str
    #: The stage type's own options.
    with_: dict[str, Any] = Field(default_factory=dict, alias="with")
    #: The steps this one waits for (their outputs are read as steps.ID.FIELD). Left out: the step before it in
    #: the file (every step before it, for an always step); []: none, it starts with the request.
    needs: list[str] | None = None
    #: Run the stage only when this expression holds, e.g. ``tags.tier == 'gold'`` or
    #: ``steps.classify.output.intent == 'refund'``; skipped otherwise (recorded as skipped).
    when: str | None = None
    #: Run even after a failure, denial or cancellation (audit).
    always: bool = False
    #: fail: the request fails; skip: record the error and go on.
    on_error: Literal["fail", "skip"] = "fail"
    #: A stage running longer is cancelled and counts as failed.
    timeout_s: PositiveFloat | None = None
    #: Run the step again when it fails (the runner's retries; see RetrySpec).
    retry: RetrySpec | None = None
    #: Another step that runs in this one's place when it fails (after its retries), e.g. the same call on
    #: another model; its outputs are then this step's.
    fallback: str | None = Field(None, pattern=_NAME)
    #: This step's text goes to the client (several only as alternatives, each with its own when:; default: a
    #: stream stage, else the model calls no other step reads).
    stream: bool = False
    #: Run the step once per item of a list another step gives (``steps.split.chunks``); the item is ``item``
    #: (and ``item_index``) in its templates and when:, and each output is the list of the items' outputs.
    for_each: str | None = None
    #: With for_each: how many items run at the same time.
    concurrency: int = Field(4, ge=1, le=64)
    #: Close a loop over the steps from repeat.from to this one (see RepeatSpec).
    repeat: RepeatSpec | None = None

    @model_validator(mode="after")
    def _concurrency_needs_for_each(self) -> StageSpec:
        if "concurrency" in self.model_fields_set and self.for_each is None:
            raise ValueError("concurrency: applies to a for_each: step only; add for_each: or remove concurrency:")
        return self


#: The roles an API key may have (``inferline keys create --role``; store/keys.py keeps the same list, and a
#: test holds the two together): ``caller`` calls pipelines, ``auditor`` reads audits and metrics, ``admin`` all.
ROLES = ("caller", "auditor", "admin")


def hint(message: str) -> PydanticCustomError:
    """A validation error whose message is complete as written: what is wrong and what to write instead."""
    return PydanticCustomError("spec_hint", "{hint}", {"hint": message})


def _known_role(role: str) -> str:
    if role not in ROLES:  # quietly locking out the callers a typo meant to let in
        raise hint(f"unknown role {role!r}{suggest(role, ROLES)} (roles: {', '.join(ROLES)})")
    return role


#: One of :data:`ROLES`; editors offer the list (``inferline schema pipeline``).
Role = Annotated[str, AfterValidator(_known_role), WithJsonSchema({"type": "string", "enum": list(ROLES)})]


class AccessSpec(Strict):
    """Who may call the pipeline: keys with one of ``roles`` (admins always may)."""

    #: Roles of the API keys that may call it: caller, auditor, admin.
    roles: list[Role] = Field(default_factory=lambda: ["caller"])


class SLOSpec(Strict):
    """Service-level objectives of a pipeline (serving/runtime/slo.py judges each request against them).

    A ``*_p95`` objective holds when 95% of requests are within it; ``max_cost_usd_per_request`` when
    every request is. Absent objectives are not judged.
    """

    #: Time to the first text delta.
    ttft_ms_p95: PositiveFloat | None = None
    #: A request's inter-token latency: (last token - first token) / (output tokens - 1).
    itl_ms_p95: PositiveFloat | None = None
    #: The whole request, arrival to the final event.
    e2e_ms_p95: PositiveFloat | None = None
    #: The most one request may cost.
    max_cost_usd_per_request: PositiveFloat | None = None

    @model_validator(mode="after")
    def _some(self) -> SLOSpec:
        if not self.model_fields_set:
            raise ValueError("give at least one objective: ttft_ms_p95, itl_ms_p95, e2e_ms_p95 or "
                             "max_cost_usd_per_request (or leave slo: out)")
        return self


class PipelineSpec(Strict):
    """One pipeline file: one endpoint."""

    #: The pipeline's endpoint, /pipelines/<name>: lowercase letters, digits, '-' and '_' (at most 128).
    name: str = Field(pattern=_NAME, max_length=MAX_PIPELINE_NAME)
    #: What it does, for the console and the API's listing.
    description: str = ""
    #: A label recorded in traces and audit records.
    version: str = "1"
    #: Who may call it.
    access: AccessSpec = Field(default_factory=AccessSpec)
    #: Objectives that serving, ``inferline load`` and ``inferline plan`` measure attainment against.
    slo: SLOSpec | None = None
    #: What a request goes through, in order.
    stages: list[StageSpec] = Field(min_length=1)

    @field_validator("stages", mode="before")
    @classmethod
    def _some_stages(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise hint("a pipeline needs at least one stage, e.g. stages: [{id: prompt, type: prompt}]")
        return value

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that loads back into an equal spec (used by ``dump``)."""
        return self.model_dump(by_alias=True, exclude_defaults=True, mode="json")
