"""A pipeline as the loader leaves it: its spec, each step's plan, and the graph of its steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from pipeline.expr import Expression
from pipeline.graph import Graph
from pipeline.spec import PipelineSpec, StageSpec
from pipeline.stage import Stage
from pipeline.types import ValueType


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One validated stage: its spec, class, parsed config and condition."""

    spec: StageSpec
    cls: type[Stage]
    config: BaseModel
    when: Expression | None
    #: What ``steps.ID.FIELD`` reads of it (its outputs' types; ``status`` besides).
    outputs: dict[str, ValueType] = field(default_factory=dict)
    #: With ``repeat:``, the loop's end condition.
    until: Expression | None = None


@dataclass(frozen=True, slots=True)
class LoadedPipeline:
    """A pipeline that passed every load-time check."""

    spec: PipelineSpec
    file: str
    sha256: str
    plans: tuple[StagePlan, ...]
    #: Line and column of its ``name:`` value, for errors that involve several files (two of one name).
    name_at: tuple[int, int] = (1, 1)
    #: The YAML text it was loaded from (``sha256`` is its hash): what a pipeline version keeps.
    text: str = ""
    #: The graph of its steps (pipeline/graph.py): what each needs, and in what order they may run.
    graph: Graph | None = None

    def plan(self, step_id: str) -> StagePlan:
        return next(plan for plan in self.plans if plan.spec.id == step_id)
