"""What flows between a pipeline's steps, checked at load over its graph (pipeline/graph.py).

Two kinds of data flow between steps:

* **flow fields** of the request context (``messages``, ``documents``, ``prompt_ids``...), which the chain
  stages read and write: a step reads a field that the request brings or that a step it runs after
  writes; two steps that may run at the same time must not both write a field that a later step reads;
* **step outputs**, read by name as ``steps.ID.FIELD`` in ``when:`` expressions, templates and options: the step
  exists, runs before the reader (it is among the reader's needs, directly or not), gives that field (typed:
  ``steps.classify.output.intent`` is known to be one of its JSON Schema's enum values), and, when it may be
  skipped (a ``when:`` of its own), is read inside ``coalesce(...)`` or through its ``status``.

Each problem comes back as a :class:`FlowIssue` (the step's index, the key in its entry, the message, and a
column inside that value when known), which the loader locates in the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.context import EXPRESSION_TYPES, FIELDS, field_type
from pipeline.diagnostics import suggest
from pipeline.errors import ExpressionError
from pipeline.exprtypes import TypeChecker
from pipeline.graph import Graph
from pipeline.plan import StagePlan
from pipeline.registry import StageRegistry
from pipeline.types import UNKNOWN, ValueType

#: The root name of step outputs in expressions and templates.
STEPS = "steps"
#: What every step gives besides its outputs.
STATUS = "status"
#: A for_each step's item, and its place in the list, in its templates and when:.
ITEM, ITEM_INDEX = "item", "item_index"
#: What each step of a loop gives besides its last round's outputs: every round's.
ROUNDS = "rounds"


@dataclass(frozen=True, slots=True)
class FlowIssue:
    index: int
    key: tuple[str | int, ...]
    message: str
    #: 1-based column inside the value at *key* (an expression's), 0 when not known.
    col: int = 0


def step_types(plans: Sequence[StagePlan]) -> dict[str, ValueType]:
    """``steps``'s fields: each step's outputs with their types, and its status."""
    return {plan.spec.id: ValueType.record({**plan.outputs, STATUS: ValueType.of(str)}, name=f"step {plan.spec.id}")
            for plan in plans}


def check_flow(plans: Sequence[StagePlan], graph: Graph, registry: StageRegistry) -> list[FlowIssue]:
    """Every problem of the data flow of *plans* (file order) over *graph*."""
    by_id = {plan.spec.id: plan for plan in plans}
    issues: list[FlowIssue] = []
    steps_type = ValueType.record(step_types(plans), name=STEPS)
    for index, plan in enumerate(plans):
        issues += _fields(index, plan, plans, graph, registry)
        issues += _before(index, plan, plans, graph)
        issues += _references(index, plan, by_id, graph)
    issues += _retry_layers(plans)
    for index, plan in enumerate(plans):
        issues += _for_each(index, plan, by_id, graph) + _loop(index, plan, graph)
    if not issues:  # a reference that does not resolve would make every type check below fail with it
        names = {**EXPRESSION_TYPES, STEPS: steps_type}
        for index, plan in enumerate(plans):
            item = _item_type(plan, by_id)
            scoped = names | ({ITEM: item, ITEM_INDEX: ValueType.of(int)} if item is not None else {})
            for key, expression in (("when",), plan.when), (("repeat", "until"), plan.until):
                if expression is None:
                    continue
                try:
                    TypeChecker(expression.source.strip(), scoped).check(expression.tree)
                except ExpressionError as exc:
                    lead = len(expression.source) - len(expression.source.lstrip())
                    issues.append(FlowIssue(index, key, f"bad expression: {exc}", exc.col + lead if exc.col > 0 else 0))
    return issues


def graph_outputs(plans: Sequence[StagePlan], graph: Graph) -> list[StagePlan]:
    """*plans* with the outputs their place in *graph* gives them: a for_each step's outputs are lists (one per
    item, in order); each step of a loop also gives ``rounds``, every round's outputs."""
    found = []
    for plan in plans:
        outputs = dict(plan.outputs)
        if plan.spec.for_each is not None:
            outputs = {name: ValueType(frozenset({"list"}), items=kind, name=f"list[{kind.name}]")
                       for name, kind in outputs.items()}
        if graph.loop_of(plan.spec.id) is not None:
            outputs[ROUNDS] = ValueType(frozenset({"list"}), items=ValueType.record(
                {**outputs, STATUS: ValueType.of(str)}), name="list[round]")
        found.append(dataclasses.replace(plan, outputs=outputs))
    return found


def _source(plan: StagePlan) -> tuple[str, ...] | None:
    """A for_each step's list, as a path (``steps``, ID, FIELD...); None when it names none."""
    text = plan.spec.for_each
    parts = tuple(text.strip().split(".")) if text else ()
    return parts if len(parts) >= 3 and parts[0] == STEPS and all(part.isidentifier() for part in parts) else None


def _item_type(plan: StagePlan, by_id: dict[str, StagePlan]) -> ValueType | None:
    path = _source(plan)
    if path is None or path[1] not in by_id:
        return None
    value = {**by_id[path[1]].outputs, STATUS: ValueType.of(str)}.get(path[2])
    for part in path[3:]:
        value = value.without_null().field(part) if value is not None else None
    return value.items if value is not None and value.items is not None else UNKNOWN


def _for_each(index: int, plan: StagePlan, by_id: dict[str, StagePlan], graph: Graph) -> list[FlowIssue]:
    reads_item = _reads_item(plan)
    if plan.spec.for_each is None:
        return [FlowIssue(index, ("type",), f"step {plan.spec.id!r} reads item, which only a for_each: step has: add "
                                            "for_each: steps.ID.FIELD (a list)")] if reads_item else []
    key = ("for_each",)
    path = _source(plan)
    if path is None:
        return [FlowIssue(index, key, f"for_each names a list another step gives, as steps.ID.FIELD "
                                      f"(steps.split.chunks), not {plan.spec.for_each!r}")]
    message = _reference(plan, path, False, by_id, graph)
    if message:
        return [FlowIssue(index, key, message)]
    source = by_id[path[1]]
    value = {**source.outputs, STATUS: ValueType.of(str)}[path[2]]
    for part in path[3:]:
        value = value.without_null().field(part) or UNKNOWN
    if value.kinds is not None and "list" not in value.kinds:
        return [FlowIssue(index, key, f"{'.'.join(path)} is {value.describe()}, not a list: for_each runs the step "
                                      "once per item of a list")]
    if plan.cls.writes:
        return [FlowIssue(index, key, f"a for_each step runs its items at the same time, and a {plan.spec.type} step "
                                      f"writes the request's {', '.join(sorted(plan.cls.writes))}: make it an llm or "
                                      "pipeline step, whose outputs are its own")]
    return []


def _reads_item(plan: StagePlan) -> bool:
    names = set(plan.when.names) if plan.when is not None else set()
    names |= {name for template in plan.cls.templates(plan.config).values() for name in template.names}
    return bool(names & {ITEM, ITEM_INDEX})


def _loop(index: int, plan: StagePlan, graph: Graph) -> list[FlowIssue]:
    """A loop ends: its until reads what the loop's steps give (else each round would decide the same)."""
    if plan.until is None:
        return []
    body = graph.loops.get(plan.spec.id, ())
    read = {path[1] for path, _ in plan.until.paths if path[0] == STEPS and len(path) > 1}
    if not read & set(body):
        return [FlowIssue(index, ("repeat", "until"), f"the loop's until reads nothing its steps "
                                                      f"({', '.join(body)}) give, so it would never end: test one "
                                                      f"of their outputs, as steps.{plan.spec.id}.output...")]
    return []


def _writers(field: str, among: frozenset[str], plans: Sequence[StagePlan]) -> list[StagePlan]:
    return [plan for plan in plans if plan.spec.id in among and field in plan.cls.writes]


def _fields(index: int, plan: StagePlan, plans: Sequence[StagePlan], graph: Graph,
            registry: StageRegistry) -> list[FlowIssue]:
    before = graph.ancestors[plan.spec.id]
    needs = [(("type",), f) for f in sorted(plan.cls.required_reads(plan.config))]
    needs += [(("when",), f) for f in sorted(plan.when.names - {STEPS, ITEM, ITEM_INDEX})] if plan.when else []
    issues = []
    for key, name in needs:
        if FIELDS.get(name) is not None and FIELDS[name].initial:
            continue
        writers = _writers(name, before, plans)
        if not writers:
            issues.append(FlowIssue(index, key, _missing(plan, name, plans, graph, registry)))
            continue
        unordered = next(((a, b) for i, a in enumerate(writers) for b in writers[i + 1:]
                          if not graph.ordered(a.spec.id, b.spec.id)), None)
        if unordered is not None:
            a, b = unordered
            issues.append(FlowIssue(index, key, f"step {plan.spec.id!r} reads {name!r}, which steps {a.spec.id!r} "
                                    f"and {b.spec.id!r} both write and may run at the same time: order them with "
                                    f"needs:, or read steps.{a.spec.id}.{name} / steps.{b.spec.id}.{name}"))
    return issues


def _missing(plan: StagePlan, name: str, plans: Sequence[StagePlan], graph: Graph, registry: StageRegistry) -> str:
    stage = plan.spec
    head = f"stage {stage.id!r} ({stage.type}) reads {name!r} ({field_type(name).name}), which no earlier stage writes"
    elsewhere = [p.spec for p in plans if name in p.cls.writes and p.spec.id not in graph.fallback_only
                 and p.spec.id != stage.id]
    if elsewhere:
        other = elsewhere[0]
        if graph.runs_before(stage.id, other.id) or plans.index(plan) < plans.index(next(
                p for p in plans if p.spec.id == other.id)):
            return f"{head}; stage {other.id!r} ({other.type}) writes it: move it before {stage.id!r}"
        return f"{head}; stage {other.id!r} ({other.type}) writes it: add {other.id!r} to the needs of {stage.id!r}"
    providers = registry.providers(name)
    if providers:
        return f"{head}; add a stage of type {' or '.join(providers)} before it"
    return f"{head}; no registered stage type writes it"


def _before(index: int, plan: StagePlan, plans: Sequence[StagePlan], graph: Graph) -> list[FlowIssue]:
    """A stage that decides what later stages do (policy before generate) runs before every one of them."""
    if not plan.cls.before:
        return []
    for other in plans:
        if other.spec.type in plan.cls.before and not graph.runs_before(plan.spec.id, other.spec.id):
            where = "move it up" if plans.index(other) < index else \
                f"add {plan.spec.id!r} to {other.spec.id!r}'s needs"
            return [FlowIssue(index, ("type",), f"stage {plan.spec.id!r} ({plan.spec.type}) must come before "
                                                f"stage {other.spec.id!r} ({other.spec.type}), whose work it decides: "
                                                f"{where}")]
    return []


def _references(index: int, plan: StagePlan, by_id: dict[str, StagePlan], graph: Graph) -> list[FlowIssue]:
    """Each ``steps.ID.FIELD`` *plan* reads: in its ``when:``, its templates and its options."""
    found: list[tuple[tuple[str | int, ...], tuple[str, ...], bool]] = []
    if plan.when is not None:
        found += [(("when",), path, coalesced) for path, coalesced in plan.when.paths if path[0] == STEPS]
    if plan.until is not None:  # read after the step itself, so its own outputs too
        found += [(("repeat", "until"), path, coalesced) for path, coalesced in plan.until.paths
                  if path[0] == STEPS and path[1:2] != (plan.spec.id,)]
    for loc, template in plan.cls.templates(plan.config).items():
        found += [(("with", *loc), path, coalesced) for path, coalesced in template.paths if path[0] == STEPS]
    found += [(("with", *loc), (STEPS, step, output), False) for loc, step, output in plan.cls.step_reads(plan.config)]
    issues = []
    for key, path, coalesced in found:
        message = _reference(plan, path, coalesced, by_id, graph)
        if message:
            issues.append(FlowIssue(index, key, message))
    return issues


def _reference(plan: StagePlan, path: tuple[str, ...], coalesced: bool, by_id: dict[str, StagePlan],
               graph: Graph) -> str:
    """What is wrong with reading *path* (``steps``, ID, FIELD...) from *plan*; '' when nothing is."""
    shown = ".".join(path)
    if len(path) < 3:
        return f"{shown}: name a step and one of its outputs, as steps.ID.FIELD (steps.classify.output)"
    step_id, output = path[1], path[2]
    source = by_id.get(step_id)
    if source is None:
        return f"{shown}: no step {step_id!r}{suggest(step_id, list(by_id))} (steps: {', '.join(by_id)})"
    if step_id in graph.fallback_only:
        primary = next(p for p, f in graph.fallbacks.items() if f == step_id)
        return f"{shown}: step {step_id!r} runs only in the place of {primary!r}: read steps.{primary}.{output}"
    if step_id == plan.spec.id:
        return f"{shown}: a step cannot read its own outputs"
    loop = graph.loop_of(step_id)
    earlier_round = loop is not None and loop == graph.loop_of(plan.spec.id)  # a later step's previous round
    if not graph.runs_before(step_id, plan.spec.id) and not earlier_round:
        when = "after it" if graph.runs_before(plan.spec.id, step_id) else "beside it, not before"
        return f"{shown}: step {step_id!r} runs {when}: add {step_id!r} to the needs of {plan.spec.id!r}"
    if earlier_round and not graph.runs_before(step_id, plan.spec.id) and output != STATUS and not coalesced:
        return (f"{shown}: step {step_id!r} runs after {plan.spec.id!r} in their loop: what it gave in the round "
                f"before (none in the first) is read as coalesce({shown}, ...)")
    gives = {**source.outputs, STATUS: ValueType.of(str)}
    if output not in gives:
        return (f"{shown}: step {step_id!r} ({source.spec.type}) gives no {output!r}{suggest(output, list(gives))} "
                f"(it gives: {', '.join(gives)})")
    value = gives[output]
    for depth, part in enumerate(path[3:], start=3):
        record = value.without_null()
        if record.fields is None:
            break
        if record.field(part) is None:
            known = record.field_names()
            return (f"{shown}: {'.'.join(path[:depth])} has no field {part!r}{suggest(part, known)} "
                    f"(its fields: {', '.join(known)})")
        value = record.field(part)  # type: ignore[assignment]
    if source.spec.when is not None and output != STATUS and not coalesced:
        return (f"{shown}: step {step_id!r} runs only when its when: holds, so it may give nothing: read it as "
                f"coalesce({shown}, ...) with what to use otherwise, or test steps.{step_id}.status")
    return ""


def reads_of(plan: StagePlan) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What *plan*'s step reads: the flow fields (its type's and its ``when:``'s), and each earlier step's output
    it names (step, field), wherever it names them."""
    fields = set(plan.cls.required_reads(plan.config)) | (set(plan.when.names) - {STEPS} if plan.when else set())
    paths = [path for path, _ in plan.when.paths] if plan.when is not None else []
    paths += [path for template in plan.cls.templates(plan.config).values() for path, _ in template.paths]
    steps = {(path[1], path[2]) for path in paths if path[0] == STEPS and len(path) >= 3}
    steps |= {(step, output) for _, step, output in plan.cls.step_reads(plan.config)}
    return tuple(sorted(fields & set(FIELDS))), tuple(sorted(steps))


def _retry_layers(plans: Sequence[StagePlan]) -> list[FlowIssue]:
    """Retries in one layer only: a route's ``retries`` (each model again, before its fallbacks) and a runner's
    ``retry:`` on a model call would multiply (3 x 3 calls for "3 attempts"), so a file has one or the other."""
    routed = next((p for p in plans if p.cls.model_retries(p.config) > 0), None)
    if routed is None:
        return []
    return [FlowIssue(plans.index(p), ("retry",), f"step {routed.spec.id!r} ({routed.spec.type}) already retries each "
                      f"model {routed.cls.model_retries(routed.config)} time(s): retries in both would multiply; keep "
                      f"its retries or this retry:, not both (route's covers a model's failure before its fallbacks, "
                      f"retry: any failure of this step)")
            for p in plans if p.spec.retry is not None and p.cls.is_model_call]
