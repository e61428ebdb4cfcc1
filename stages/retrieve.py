"""The ``retrieve`` stage: finds the passages a question needs in an index, by meaning, by words, or both.

YAML::

    - id: context
      type: retrieve
      with:
        index: handbook          # a name under `indexes:` in inferline.yaml
        top_k: 4
        mode: hybrid             # dense | keyword | hybrid (default: hybrid, dense on an index built before BM25)
        fusion: rrf              # hybrid: rrf (reciprocal rank fusion, rrf_k 60) or weighted
        min_score: 0.25          # drop candidates whose cosine similarity is lower (-1..1), in every mode
        query: "{{ input }}"     # a template over context fields; default: the last user message
        filters: {tenant: "{{ tenant }}", updated: {gte: 2025-01-01}}   # see stages/filters.py
        rerank: {model: minilm-ce, top_n: 20}                          # a name under `rerankers:`

Writes ``documents`` (text, source, title, score, page), best first; the ``prompt`` and ``llm`` stages place
them in the prompt as numbered sources. Filters are applied inside each side's search, before its top k.
The trace and the audit record get the index, its version, the mode, each side's ids and scores, the fused
order and the reranker's (``ctx.facts["retrieval"]``, one entry per retrieve step under ``steps``).
"""

from __future__ import annotations

import asyncio
import time
from functools import cached_property
from typing import Any, Literal, cast

from pydantic import BaseModel, Field

from pipeline.context import FIELDS, Document, RequestContext
from pipeline.errors import BackendError, TemplateError
from pipeline.protocols import Catalog, Resources, SearchHit
from pipeline.refs import IndexRef
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.template import Template, compile_template
from stages.filters import BUILTIN_FIELDS, FilterError, Group, parse, template_sources
from stages.rerank import RerankConfig, Reranked, rerank

Side = Literal["dense", "keyword"]


class RetrieveConfig(NoConfig):
    #: One of inferline.yaml's indexes.
    index: IndexRef
    #: Documents returned.
    top_k: int = Field(4, ge=1, le=100)
    #: dense (embeddings), keyword (BM25) or hybrid (both, fused); default: hybrid where the index has a keyword
    #: side (every index built since they have one), else dense.
    mode: Literal["dense", "keyword", "hybrid"] | None = None
    #: hybrid: how the two rankings become one: rrf (reciprocal rank fusion) or weighted (min-max scaled scores).
    fusion: Literal["rrf", "weighted"] = "rrf"
    #: fusion rrf: the constant k of 1 / (k + rank); larger flattens the lead of the first ranks.
    rrf_k: int = Field(60, ge=1, le=10_000)
    #: hybrid: each side's weight in the fusion (default 1 each).
    weights: dict[Side, float] = Field(default_factory=dict)
    #: hybrid: candidates each side gives the fusion.
    candidates: int = Field(50, ge=1, le=1000)
    #: Leave out candidates whose cosine similarity to the query is below this (every mode).
    min_score: float | None = Field(None, ge=-1, le=1)
    #: What is searched for: a template over context fields.
    query: str = "{{ input }}"
    #: Only documents whose metadata match (equality, in, ranges, and/or; templates from the request).
    filters: dict[str, Any] = Field(default_factory=dict)
    #: Re-score the best ``top_n`` candidates with a reranker of inferline.yaml before keeping ``top_k``.
    rerank: RerankConfig | None = None

    @cached_property
    def template(self) -> Template:
        return compile_template(self.query)

    @cached_property
    def filter_templates(self) -> dict[tuple[str | int, ...], Template]:
        return {("filters", *loc): t for loc, t in template_sources(self.filters).items()}


def index_fields(catalog: Catalog, index: str) -> dict[str, str]:
    """The fields *index*'s filters may name: the built-in ones and those inferline.yaml declares."""
    return {**BUILTIN_FIELDS, **catalog.index_fields.get(index, {})}


class RetrieveStage(Stage):
    type_name = "retrieve"
    Config = RetrieveConfig
    reads = frozenset({"input"})
    writes = frozenset({"documents"})

    def __init__(self, stage_id: str, config: BaseModel, resources: Resources):
        super().__init__(stage_id, config, resources)
        config = cast(RetrieveConfig, config)
        self._where: Group = parse(config.filters, index_fields(resources.catalog, config.index))

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        try:
            names = set(cast(RetrieveConfig, config).template.names)
        except TemplateError:
            return frozenset()
        names |= {n for t in cast(RetrieveConfig, config).filter_templates.values() for n in t.names}
        return frozenset(names & FIELDS.keys())

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        config = cast(RetrieveConfig, config)
        issues: list[CheckIssue] = []
        try:
            unknown = sorted(config.template.names - FIELDS.keys() - {"steps"})
            issues += [(("query",), f"template names unknown field {n!r}") for n in unknown]
        except TemplateError as exc:
            issues.append((("query",), str(exc)))
        try:
            parse(config.filters, index_fields(catalog, config.index))
        except FilterError as exc:
            issues.append((("filters", *exc.loc), exc.message))
        if config.rerank is not None and config.rerank.top_n < config.top_k:
            issues.append((("rerank", "top_n"), f"top_n ({config.rerank.top_n}) must be at least top_k "
                                                f"({config.top_k}): the reranker picks the top_k among them"))
        if any(weight < 0 for weight in config.weights.values()):
            issues.append((("weights",), "weights must be 0 or more"))
        return issues

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        config = cast(RetrieveConfig, config)
        return {("query",): config.template, **config.filter_templates}

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(RetrieveConfig, self.config)
        index = self.resources.indexes.get(config.index)
        if index is None:
            raise BackendError(f"index {config.index!r} is not loaded: build it with "
                               f"`inferline index build DOCS --name {config.index}`")
        names = config.template.names | {n for t in config.filter_templates.values() for n in t.names}
        values = {n: ctx.field_value(n) for n in names}
        query = config.template.render(values).strip()
        where = self._where.render(values) if self._where.parts else None
        wanted = max(config.top_k, config.rerank.top_n) if config.rerank else config.top_k
        try:
            found = await asyncio.to_thread(
                index.retrieve, query, wanted, mode=config.mode, min_score=config.min_score, where=where,
                fusion=config.fusion, rrf_k=config.rrf_k, weights=config.weights or None,
                candidates=config.candidates)
        except ValueError as exc:  # a mode the index cannot search (built before it had a keyword side)
            raise BackendError(str(exc)) from None
        hits, scores = list(found.hits), [h.score for h in found.hits]
        entry = {"index": index.name, "version": index.version, "mode": found.mode,
                 "dense": _side(found.dense), "keyword": _side(found.keyword)}
        if found.mode == "hybrid":
            entry["fused"] = {"ids": [h.id for h in hits], "scores": [round(s, 6) for s in scores]}
        if config.rerank is not None and hits:
            started = time.perf_counter()
            reranked = await rerank(self.resources, config.rerank.model, query, [_passage(h) for h in hits],
                                    ctx.tenant)
            self._account(reranked, scope)
            order = sorted(range(len(hits)), key=lambda i: -reranked.scores[i])  # stable: ties keep the search's order
            hits, scores = [hits[i] for i in order], [reranked.scores[i] for i in order]
            entry["rerank"] = {"model": config.rerank.model, "ids": [h.id for h in hits],
                               "scores": [round(s, 4) for s in scores]}
            scope.set_attribute("inferline.retrieval.rerank_ms", round((time.perf_counter() - started) * 1e3, 2))
        hits, scores = hits[:config.top_k], scores[:config.top_k]
        ids, rounded = [h.id for h in hits], [round(s, 4) for s in scores]
        entry.update(ids=ids, scores=rounded)
        self._record(ctx, scope, entry, where)
        ctx.documents = [Document(h.id, h.text, h.source, h.title, score, getattr(h, "page", None))
                         for h, score in zip(hits, scores, strict=True)]

    def _record(self, ctx: RequestContext, scope: StageScope, entry: dict[str, Any], where: Any) -> None:
        # The top level is what the console shows (the last retrieve step to finish); each step's is under steps.
        steps = {**(ctx.facts.get("retrieval") or {}).get("steps", {}), self.id: entry}
        ctx.facts["retrieval"] = {**entry, "steps": steps}
        decision: dict[str, Any] = {"documents": len(entry["ids"]), "mode": entry["mode"]}
        if where is not None:  # the fields only: a value may come from the request's text
            decision["filtered_on"] = sorted(_fields_of(where))
        if "rerank" in entry:
            decision["reranked"] = len(entry["rerank"]["ids"])
        ctx.facts.setdefault("decisions", {})[self.id] = decision
        for key in ("index", "version", "mode", "ids", "scores"):
            scope.set_attribute(f"inferline.retrieval.{key}", entry[key])
        for side in ("dense", "keyword"):
            scope.set_attribute(f"inferline.retrieval.{side}.ids", entry[side]["ids"])

    def _account(self, reranked: Reranked, scope: StageScope) -> None:
        if not reranked.model:
            return
        info = self.resources.catalog.models.get(reranked.model)
        if info is not None:
            scope.add_cost(info.price.tokens_usd(reranked.input_tokens, reranked.output_tokens), "tokens",
                           f"rerank {reranked.model}: {reranked.input_tokens} in, {reranked.output_tokens} out")
        scope.add_tokens(reranked.input_tokens, reranked.output_tokens)


def _side(pairs: Any) -> dict[str, list[Any]]:
    return {"ids": [doc_id for doc_id, _ in pairs], "scores": [round(float(score), 4) for _, score in pairs]}


def _passage(hit: SearchHit) -> str:
    return f"{hit.title}\n\n{hit.text}" if hit.title else hit.text


def _fields_of(where: Any) -> set[str]:
    if "field" in where:
        return {where["field"]}
    return {name for part in where.get("and", where.get("or", [])) for name in _fields_of(part)}
