"""The stage base class.

A stage type is a class with a pydantic ``Config`` (what its YAML ``with:``
accepts), the flow fields it ``reads`` and ``writes``, and ``async run``.
The runner, not the stage, opens the span and times the stage; the stage
reports cost, attributes and text through the :class:`StageScope` it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, get_type_hints

from pydantic import BaseModel, ConfigDict

from pipeline.context import ChatMessage, RequestContext, TokenLogprob, field_type
from pipeline.events import StageFinished, StageStarted
from pipeline.protocols import Catalog, Resources
from pipeline.template import Template
from pipeline.types import ValueType

#: A problem found by :meth:`Stage.check`: a path inside ``with:`` and a message, and optionally the
#: 1-based column within that value's text where the problem is (an error inside a ``when:`` expression).
CheckIssue = tuple[tuple[str | int, ...], str] | tuple[tuple[str | int, ...], str, int]


class NoConfig(BaseModel):
    """The config of a stage that takes no options."""

    model_config = ConfigDict(extra="forbid")


class StageScope(Protocol):
    """What a running stage may tell the runner."""

    async def emit_text(self, text: str, index: int = 0, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """Send a text delta to the client (of answer *index*, when the request asked for several), with the
        log-probabilities of the tokens it came from (when asked for)."""
        ...

    def add_cost(self, usd: float, kind: str = "other", detail: str = "") -> None:
        """Record a cost of this stage in the request's ledger."""
        ...

    def set_attribute(self, key: str, value: Any) -> None:
        """Set an attribute on this stage's span (GenAI conventions where they apply)."""
        ...

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        """Add an event to this stage's span (a policy decision, a fallback taken...)."""
        ...

    @property
    def streams(self) -> bool:
        """Whether this step's text is the answer the client gets (its ``emit_text`` reaches the client)."""
        ...

    @property
    def holds_text(self) -> bool:
        """Whether a streaming step must check its whole output before sending any of it (another attempt
        follows an invalid or empty one, and a retried attempt's text never reaches the client)."""
        ...

    def add_tokens(self, input_tokens: int, output_tokens: int) -> None:
        """Count the model tokens this step used (its trace row and audit record show them)."""
        ...

    def end_request(self) -> None:
        """This step answered the request: the steps after it are skipped (``always`` ones still run)."""
        ...

    def emit_step(self, event: StageStarted | StageFinished) -> None:
        """A step run under this one (a sub-pipeline's) started or ended: sent on, its ``parent`` under this step's
        id, to the request's event stream (the client's SSE ``stage`` events)."""
        ...


class Stage:
    """Base class of every stage type; subclass it and register the subclass."""

    #: The short name pipelines use in ``type:``; set by the registry if empty.
    type_name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = NoConfig
    #: Flow fields this stage needs (see ``pipeline.context.FIELDS``).
    reads: ClassVar[frozenset[str]] = frozenset()
    #: Flow fields this stage provides to later stages.
    writes: ClassVar[frozenset[str]] = frozenset()
    #: Stage types this one must come before (it decides what they do): checked at load.
    before: ClassVar[frozenset[str]] = frozenset()
    #: The step's outputs (``steps.ID.FIELD``), when it gives others than the flow fields it writes: a slotted
    #: dataclass whose annotations are their types; ``run`` returns one.
    Outputs: ClassVar[type | None] = None
    #: A model call: the last one of a pipeline streams its text to the client unless a step says ``stream: true``.
    is_model_call: ClassVar[bool] = False
    #: It sends the request's answer to the client itself (``stream``, ``reply``): its text always goes out.
    sends_answer: ClassVar[bool] = False
    #: It keeps a record of every step (``audit``): a pipeline with one has each step's inputs and output kept.
    records_steps: ClassVar[bool] = False
    #: It sends the text of a chain's model call (``stream``): a pipeline with one answers through it, not
    #: through its last ``llm`` step.
    answers_chain: ClassVar[bool] = False
    #: It may pause the request for the client's approval and be resumed by a later one (``agent``).
    pauses_for_approval: ClassVar[bool] = False

    def __init__(self, stage_id: str, config: BaseModel, resources: Resources):
        self.id = stage_id
        self.config = config
        self.resources = resources
        #: The pipeline version it serves, (name, spec SHA-256), set as the version is instantiated (before any
        #: request); ("", "") for a pipeline built for one request, whose tools are pinned for it alone.
        self.version = ("", "")

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        """The fields this configured instance needs; override when config-dependent."""
        return cls.reads

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        """Load-time checks beyond the config schema (model names, templates...)."""
        return []

    @classmethod
    def output_types(cls, config: BaseModel) -> dict[str, ValueType]:
        """What ``steps.ID.FIELD`` may read of this configured step, with its type: the fields of
        :attr:`Outputs`, else the flow fields it writes. Override when a type depends on the config (an
        ``llm`` step's output is typed by its JSON Schema)."""
        if cls.Outputs is not None:
            hints = get_type_hints(cls.Outputs)
            return {f.name: ValueType.of(hints[f.name]) for f in dataclasses.fields(cls.Outputs)}
        return {name: field_type(name) for name in sorted(cls.writes)}

    @classmethod
    def calls(cls, config: BaseModel) -> list[tuple[tuple[str | int, ...], str]]:
        """The other pipelines this configured step runs, each with its place in ``with:`` (a ``score``
        step's judges, a ``pipeline`` step's callee): the server loads them beside it, and refuses a pipeline
        that calls itself, directly or through others."""
        return []

    @classmethod
    def model_retries(cls, config: BaseModel) -> int:
        """Extra attempts this configured step makes the model calls after it take (``route``'s ``retries``):
        the loader refuses them beside a runner's ``retry:`` on a model call, so that retries never multiply."""
        return 0

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        """The templates of *config* by their place in ``with:``: the loader checks the step outputs they read."""
        return {}

    @classmethod
    def step_reads(cls, config: BaseModel) -> list[tuple[tuple[str | int, ...], str, str]]:
        """Step outputs *config* names outside its templates, as (place in ``with:``, step id, output):
        checked at load like ``steps.ID.FIELD`` (an ``llm`` step's ``documents: [kb, web]``)."""
        return []

    @classmethod
    def model_of(cls, config: BaseModel) -> str | None:
        """The model this configured step names; None when it names none (it leaves it to a route or to the
        server's first model). The server's token-counting routes tokenize with it."""
        return None

    def prompt(self, ctx: RequestContext) -> list[ChatMessage] | None:
        """The messages this step would send its model for *ctx* as it stands (nothing retrieved yet); None when
        it builds no prompt. The server counts a request's prompt tokens with it (Anthropic's count_tokens)."""
        return None

    def start(self) -> None:
        """The version is being served, in a running loop: start, in the background, what should be ready before
        its first request (an ``agent`` step pins its tools). The default does nothing."""

    async def reuse(self, ctx: RequestContext, scope: StageScope, outputs: dict[str, Any]) -> None:
        """A replay reuses *outputs* (as an audit record kept them) instead of running the step: do what running
        it does besides giving them (the answering ``llm`` step sends its text). Only a step type with
        :attr:`Outputs` is reused; the default does nothing more."""

    async def run(self, ctx: RequestContext, scope: StageScope) -> Any:
        """Do the stage's work; return its :attr:`Outputs` (None: its outputs are the flow fields it wrote)."""
        raise NotImplementedError(f"stage type {self.type_name!r} does not implement run()")
