"""The stage base class.

A stage type is a class with a pydantic ``Config`` (what its YAML ``with:``
accepts), the flow fields it ``reads`` and ``writes``, and ``async run``.
The runner, not the stage, opens the span and times the stage; the stage
reports cost, attributes and text through the :class:`StageScope` it is given.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from pipeline.context import RequestContext, TokenLogprob
from pipeline.protocols import Catalog, Resources

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

    def __init__(self, stage_id: str, config: BaseModel, resources: Resources):
        self.id = stage_id
        self.config = config
        self.resources = resources

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        """The fields this configured instance needs; override when config-dependent."""
        return cls.reads

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        """Load-time checks beyond the config schema (model names, templates...)."""
        return []

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        raise NotImplementedError(f"stage type {self.type_name!r} does not implement run()")
