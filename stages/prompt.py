"""The ``prompt`` stage: builds the chat messages the model will see.

YAML::

    - id: prompt
      type: prompt
      with:
        system: "You answer questions about {{ tags.product or 'our product' }}."
        user: "{{ input }}"          # the default
        history: true                # keep the client's earlier turns (default)
        max_document_tokens: 1200    # budget for retrieved documents (lowest-ranked dropped first)

Templates are sandboxed Jinja and may name request-context fields only
(``input``, ``documents``, ``tags``, ``role``...); a name that does not exist,
or that no earlier stage writes, is a load-time error.

When retrieved ``documents`` are present and the system template does not
place them itself, they are appended to the system message as numbered
sources (``[1]``, ``[2]``...) that the answer can cite; the response's
``sources`` lists them with the same numbers (:func:`pipeline.context.sources_of`).
A system template that places ``documents`` itself should number them the same
way (``[{{ loop.index }}]``). A pipeline that sets
``system:`` drops the client's own system messages, so a caller cannot replace
the pipeline owner's instructions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import cast

from pydantic import BaseModel, Field

from pipeline.context import FIELDS, ChatMessage, Document, RequestContext, sources_of
from pipeline.errors import TemplateError
from pipeline.protocols import Catalog
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.template import Template, compile_template
from stages.engines import engine_for


class PromptConfig(NoConfig):
    #: The system message template (sandboxed Jinja over context fields); set, it replaces the client's own system
    #: messages.
    system: str | None = None
    #: The user message template.
    user: str = "{{ input }}"
    #: Keep the client's earlier turns.
    history: bool = True
    #: The line above retrieved documents when they are appended to the system message.
    sources_heading: str = "Answer from these numbered sources and cite them as [n]:"
    #: Token budget for retrieved documents in the prompt (the model's tokenizer); the lowest-ranked
    #: documents that do not fit are left out. Default: no budget.
    max_document_tokens: int | None = Field(None, gt=0)

    @cached_property
    def templates(self) -> dict[str, Template]:
        sources = {"user": self.user} if self.system is None else {"system": self.system, "user": self.user}
        return {key: compile_template(text) for key, text in sources.items()}


class PromptStage(Stage):
    """Builds ``messages`` from the templates, the client's turns and any documents."""

    type_name = "prompt"
    Config = PromptConfig
    reads = frozenset({"input_messages"})
    writes = frozenset({"messages"})

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        names = set().union(*(t.names for t in cast(PromptConfig, config).templates.values()))
        return cls.reads | (names & FIELDS.keys())

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        return template_issues(lambda: cast(PromptConfig, config).templates)

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {(key,): template for key, template in cast(PromptConfig, config).templates.items()}

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(PromptConfig, self.config)
        if ctx.documents and config.max_document_tokens is not None:
            ctx.documents = await self._within_budget(ctx, config.max_document_tokens)
        ctx.messages = self.build(ctx)

    def prompt(self, ctx: RequestContext) -> list[ChatMessage] | None:
        return self.build(ctx)

    def build(self, ctx: RequestContext) -> list[ChatMessage]:
        """The messages for *ctx*, with the documents it holds."""
        config = cast(PromptConfig, self.config)
        templates = config.templates
        messages: list[ChatMessage] = []
        system = templates.get("system")
        if system is not None:
            messages.append(ChatMessage("system", _render(system, ctx)))
        if ctx.documents and not (system is not None and "documents" in system.names):
            block = sources_block(config.sources_heading, ctx.documents)
            if messages:
                messages[0].content = f"{messages[0].content}\n\n{block}"
            else:
                messages.append(ChatMessage("system", block))
        if config.history:
            earlier = ctx.input_messages[:_last_user(ctx.input_messages)]
            messages += [ChatMessage(m.role, m.content) for m in earlier
                         if not (m.role == "system" and system is not None)]
        messages.append(ChatMessage("user", _render(templates["user"], ctx)))
        return messages

    async def _within_budget(self, ctx: RequestContext, budget: int) -> list[Document]:
        """The best-ranked documents whose texts fit in *budget* tokens together."""
        _, engine = await engine_for(self.resources, ctx.model)
        encode = engine.tokenizer.encode_chat
        overhead = len(encode([{"role": "user", "content": ""}]))
        kept, used = [], 0
        for doc in ctx.documents:
            cost = len(encode([{"role": "user", "content": doc.text}])) - overhead
            if used + cost > budget:
                break
            kept.append(doc)
            used += cost
        ctx.facts.setdefault("decisions", {})[self.id] = {"documents_used": len(kept),
                                                          "documents_dropped": len(ctx.documents) - len(kept),
                                                          "document_tokens": used}
        return kept


def _render(template: Template, ctx: RequestContext) -> str:
    return template.render({name: ctx.field_value(name) for name in template.names}).strip()


def template_issues(compiled: Callable[[], dict[str, Template]]) -> list[CheckIssue]:
    """The problems of a stage's templates (by key in ``with:``): syntax, and names that are neither a flow field
    nor ``steps`` and a for_each step's ``item`` (which the loader checks over the graph)."""
    try:
        templates = compiled()
    except TemplateError as exc:
        return [((), str(exc))]
    return [((key,), f"template names unknown field {name!r} (fields: {', '.join([*FIELDS, 'steps'])})")
            for key, template in templates.items()
            for name in sorted(template.names - FIELDS.keys() - {"steps", "item", "item_index"})]


def sources_block(heading: str, documents: list[Document]) -> str:
    """*documents* under *heading*, each numbered as the answer cites it (``[1]``) with its title and source."""
    lines = [heading]
    for cited, doc in zip(sources_of(documents), documents, strict=True):  # the numbers answers report
        title = f" {doc.title}" if doc.title else ""
        where = ", ".join(part for part in (doc.source, f"p. {doc.page}" if doc.page else "") if part)
        source = f" ({where})" if where else ""
        lines.append(f"{cited.citation}{title}{source}\n{doc.text}")
    return "\n\n".join(lines)


def _last_user(messages: list[ChatMessage]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "user":
            return index
    return len(messages)
