"""The ``retrieve`` stage: finds the passages a question needs in a vector index.

YAML::

    - id: context
      type: retrieve
      with:
        index: handbook          # a name under `indexes:` in inferline.yaml
        top_k: 4
        min_score: 0.25          # drop weaker matches (cosine similarity, -1..1)
        query: "{{ input }}"     # a template over context fields; default: the last user message
        filters: {path: "billing*"}   # glob patterns over doc_id, path or title (a list: any of them)

Writes ``documents`` (text, source, title, score), best first; the ``prompt``
stage places them in the prompt as numbered sources. The index name and
version, and each document's id and score, go to the trace
(``inferline.retrieval.*``) and the audit record.
"""

from __future__ import annotations

import asyncio
from functools import cached_property
from typing import Literal, cast

from pydantic import BaseModel, Field

from pipeline.context import FIELDS, Document, RequestContext
from pipeline.errors import BackendError, TemplateError
from pipeline.protocols import Catalog
from pipeline.refs import IndexRef
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.template import Template, compile_template


class RetrieveConfig(NoConfig):
    #: One of inferline.yaml's indexes.
    index: IndexRef
    #: Documents returned.
    top_k: int = Field(4, ge=1, le=100)
    #: Leave out documents scored below this (cosine similarity).
    min_score: float | None = Field(None, ge=-1, le=1)
    #: What is searched for: a template over context fields.
    query: str = "{{ input }}"
    #: Only documents whose doc_id, path or title matches the glob pattern (or one of several).
    filters: dict[Literal["doc_id", "path", "title"], str | list[str]] = Field(default_factory=dict)

    @cached_property
    def template(self) -> Template:
        return compile_template(self.query)


class RetrieveStage(Stage):
    type_name = "retrieve"
    Config = RetrieveConfig
    reads = frozenset({"input"})
    writes = frozenset({"documents"})

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        try:
            return frozenset(cast(RetrieveConfig, config).template.names & FIELDS.keys())
        except TemplateError:
            return frozenset()

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        try:
            names = cast(RetrieveConfig, config).template.names
        except TemplateError as exc:
            return [(("query",), str(exc))]
        unknown = sorted(names - FIELDS.keys() - {"steps"})
        return [(("query",), f"template names unknown field {n!r}") for n in unknown]

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {("query",): cast(RetrieveConfig, config).template}

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(RetrieveConfig, self.config)
        index = self.resources.indexes.get(config.index)
        if index is None:
            raise BackendError(f"index {config.index!r} is not loaded: build it with "
                               f"`inferline index build DOCS --name {config.index}`")
        query = config.template.render({n: ctx.field_value(n) for n in config.template.names}).strip()
        hits = await asyncio.to_thread(index.search, query, config.top_k, min_score=config.min_score,
                                       filters=config.filters or None)
        ctx.documents = [Document(h.id, h.text, h.source, h.title, h.score) for h in hits]
        ids, scores = [h.id for h in hits], [round(h.score, 4) for h in hits]
        ctx.facts["retrieval"] = {"index": index.name, "version": index.version, "ids": ids, "scores": scores}
        ctx.facts.setdefault("decisions", {})[self.id] = {"documents": len(hits)}
        scope.set_attribute("inferline.retrieval.index", index.name)
        scope.set_attribute("inferline.retrieval.version", index.version)
        scope.set_attribute("inferline.retrieval.ids", ids)
        scope.set_attribute("inferline.retrieval.scores", scores)
