"""Load and validate YAML files, collecting every error with its line and column.

A pipeline is validated completely before it serves a request: YAML syntax,
the pipeline schema, each stage's ``with:`` against its own config, stage
types, duplicate ids, ``when:`` expressions, model and index names, and the
typed data flow between stages. All problems of a file are raised together as
one :class:`~pipeline.errors.SpecError`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.context import EXPRESSION_TYPES
from pipeline.diagnostics import suggest, validation_issues
from pipeline.errors import ExpressionError, SpecError, SpecIssue
from pipeline.expr import Expression
from pipeline.expr import parse as parse_expression
from pipeline.flow import ITEM, ITEM_INDEX, STEPS, check_flow, graph_outputs
from pipeline.graph import Graph, Node, build_graph
from pipeline.plan import LoadedPipeline, StagePlan
from pipeline.protocols import Catalog
from pipeline.refs import find_refs
from pipeline.registry import StageRegistry
from pipeline.spec import PipelineSpec, StageSpec
from pipeline.stage import Stage
from pipeline.types import UNKNOWN
from pipeline.yamlsrc import YamlSource, parse

__all__ = ["LoadedPipeline", "StagePlan", "load_pipeline", "load_pipeline_text"]


def name_clash(pipeline: LoadedPipeline, earlier: LoadedPipeline) -> SpecIssue:
    """The error of a pipeline named as an *earlier* one: a server serves one pipeline per name, its endpoint."""
    line, col = pipeline.name_at
    return SpecIssue(pipeline.file, line, col, "name", f"pipeline name {pipeline.spec.name!r} is already used by "
                     f"{earlier.file}:{earlier.name_at[0]}:{earlier.name_at[1]}; give each pipeline its own name "
                     f"(it is its endpoint, /pipelines/{pipeline.spec.name})")


def load_pipeline(path: str | Path, registry: StageRegistry, catalog: Catalog | None = None) -> LoadedPipeline:
    """Load and validate one pipeline file."""
    return load_pipeline_text(read_text(path), str(path), registry, catalog)


def read_text(path: str | Path) -> str:
    """A YAML file's text; a file that is not UTF-8 is a SpecError at its first bad byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError([SpecIssue(str(path), line, col, "", f"the file is not UTF-8 text ({exc.reason} at "
                                                              f"byte {exc.start}); save it as UTF-8")]) from None


def load_pipeline_text(text: str, file: str, registry: StageRegistry,
                       catalog: Catalog | None = None) -> LoadedPipeline:
    """Validate pipeline YAML *text* (named *file* in messages)."""
    src = _read(file, text)
    data = src.data
    if not isinstance(data, dict):
        what = "the file is empty" if data is None else f"the top level is a {type(data).__name__}"
        raise SpecError([src.issue((), f"{what}; a pipeline is a mapping with at least "
                                       f"'name:' and 'stages:'")])
    checker = _PipelineChecker(src, registry, catalog or Catalog())
    spec, plans, graph = checker.check(data)
    if checker.issues or spec is None:
        raise SpecError(sorted(checker.issues, key=lambda i: (i.line, i.col)))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return LoadedPipeline(spec, file, digest, tuple(plans), src.position(("name",)), text, graph)


def dump_pipeline(spec: PipelineSpec) -> str:
    """YAML for *spec* that loads back into an equal spec."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False, allow_unicode=True)


def _read(file: str, text: str) -> YamlSource:
    src, issues = parse(file, text)
    if src is None or issues:
        raise SpecError(issues)
    return src


class _PipelineChecker:
    """Runs every check of one pipeline file, collecting issues rather than stopping."""

    def __init__(self, src: YamlSource, registry: StageRegistry, catalog: Catalog):
        self.src = src
        self.registry = registry
        self.catalog = catalog
        self.issues: list[SpecIssue] = []

    def check(self, data: dict[str, Any]) -> tuple[PipelineSpec | None, list[StagePlan], Graph | None]:
        spec = None
        try:
            spec = PipelineSpec.model_validate(data)
        except ValidationError as exc:
            self.issues += validation_issues(self.src, exc, PipelineSpec, data)
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, list):
            return spec, [], None
        plans = [self._stage(i, raw) for i, raw in enumerate(raw_stages)]
        self._duplicate_ids(raw_stages)
        graph = None
        kept = [p for p in plans if p is not None]
        if len(kept) == len(plans) and not self.issues:
            graph, kept = self._graph(kept)
        return spec, kept, graph

    def _graph(self, plans: list[StagePlan]) -> tuple[Graph | None, list[StagePlan]]:
        """The steps' graph, then the data flow over it (pipeline/graph.py, pipeline/flow.py); the plans with
        the outputs their graph gives them (a for_each step's are lists, a loop's steps keep their rounds)."""
        nodes = [Node(p.spec.id, None if p.spec.needs is None else tuple(p.spec.needs), p.spec.always,
                      p.spec.fallback, p.spec.stream, p.spec.when is not None,
                      p.spec.repeat.from_ if p.spec.repeat is not None else None) for p in plans]
        graph, problems = build_graph(nodes)
        for problem in problems:
            self._issue(("stages", problem.index, *problem.key), problem.message)
        if graph is None:
            return None, plans
        plans = graph_outputs(plans, graph)
        for found in check_flow(plans, graph, self.registry):
            self._issue(("stages", found.index, *found.key), found.message, col_offset=found.col)
        return graph, plans

    def _stage(self, index: int, raw: Any) -> StagePlan | None:
        # Check type, with: and when: even when the stage entry has other schema
        # errors (reported by the whole-file validation), to show every problem at once.
        if not isinstance(raw, dict):
            return None
        type_name, options, condition = raw.get("type"), raw.get("with", {}), raw.get("when")
        cls = self._type(index, type_name) if isinstance(type_name, str) else None
        config = self._config(index, cls, options) if cls is not None and isinstance(options, dict) else None
        when = self._when(index, condition) if isinstance(condition, str) else None
        try:
            stage = StageSpec.model_validate(raw)
        except ValidationError:
            return None
        until = self._when(index, stage.repeat.until, ("repeat", "until")) if stage.repeat is not None else None
        if stage.repeat is not None and stage.repeat.max > self.catalog.max_rounds:
            self._issue(("stages", index, "repeat", "max"), f"at most {self.catalog.max_rounds} rounds (the server's "
                        f"workflows.max_rounds); write a smaller max")
            return None
        if cls is None or config is None or (stage.when is not None and when is None) or \
                (stage.repeat is not None and until is None):
            return None
        return StagePlan(stage, cls, config, when, cls.output_types(config), until)

    def _type(self, index: int, type_name: str) -> type[Stage] | None:
        cls = self.registry.get(type_name)
        if cls is None:
            names = self.registry.names()
            self._issue(("stages", index, "type"), f"unknown stage type {type_name!r}"
                        f"{suggest(type_name, names)} (registered: {', '.join(names)})")
        return cls

    def _config(self, index: int, cls: type[Stage], raw: dict[str, Any]) -> BaseModel | None:
        prefix = ("stages", index, "with")
        try:
            config = cls.Config.model_validate(raw)
        except ValidationError as exc:
            self.issues += validation_issues(self.src, exc, cls.Config, raw, prefix)
            return None
        problems = [*cls.check(config, self.catalog), *self._refs(config)]
        for loc, message, *col in problems:  # a check may add a column within the value (an expression's)
            self._issue((*prefix, *loc), message, col_offset=col[0] if col else 0)
        return None if problems else config

    def _refs(self, config: BaseModel) -> list[tuple[tuple[str | int, ...], str]]:
        known = {"model": sorted(self.catalog.models), "index": sorted(self.catalog.indexes),
                 "embedding_model": sorted(self.catalog.embedding_models), "reranker": sorted(self.catalog.rerankers)}
        plural = {"model": "models", "index": "indexes", "embedding_model": "embedding_models",
                  "reranker": "rerankers"}
        problems = []
        for loc, kind, name in find_refs(config):
            if name not in known[kind]:
                listed = ", ".join(known[kind]) or "none"
                problems.append((loc, f"unknown {kind.replace('_', ' ')} {name!r}{suggest(name, known[kind])} "
                                      f"({plural[kind]} in inferline.yaml: {listed})"))
        return problems

    def _when(self, index: int, source: str, key: tuple[str, ...] = ("when",)) -> Expression | None:
        try:  # steps and item: checked over the graph
            return parse_expression(source, {**EXPRESSION_TYPES, STEPS: UNKNOWN, ITEM: UNKNOWN, ITEM_INDEX: UNKNOWN})
        except ExpressionError as exc:
            self._issue(("stages", index, *key), f"bad expression: {exc}", col_offset=exc.col)
            return None

    def _duplicate_ids(self, raw_stages: list[Any]) -> None:
        first: dict[str, int] = {}
        for index, raw in enumerate(raw_stages):
            stage_id = raw.get("id") if isinstance(raw, dict) else None
            if not isinstance(stage_id, str):
                continue
            if stage_id in first:
                self._issue(("stages", index, "id"), f"duplicate stage id {stage_id!r} "
                            f"(first used by stages[{first[stage_id]}]); stage ids must be unique")
            first.setdefault(stage_id, index)

    def _issue(self, loc: tuple[str | int, ...], message: str, col_offset: int = 0) -> None:
        issue = self.src.issue(loc, message)
        if col_offset > 0:
            issue = SpecIssue(issue.file, issue.line, issue.col + col_offset - 1 + self._quote(loc),
                              issue.loc, issue.message)
        self.issues.append(issue)

    def _quote(self, loc: tuple[str | int, ...]) -> int:
        # A quoted scalar's text starts one column after its mark.
        return 1 if self.src.char_at(*self.src.position(loc)) in ("'", '"') else 0
