"""The ``split`` step: a long text in chunks, for a ``for_each:`` step to work through (map-reduce).

YAML::

    - id: split
      type: split
      with:
        text: "{{ input }}"     # a template (the default)
        chunk_chars: 1500       # the most characters a chunk holds
        overlap_chars: 0        # characters a chunk repeats from the end of the one before

It gives ``steps.ID.chunks``, the chunks in order: cut at a paragraph's end where one is near enough, else at a
sentence's, else at a space (a word is never cut unless it is longer than a chunk), each stripped of the spaces
around it; an empty text gives no chunk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import cast

from pydantic import BaseModel, Field, model_validator

from pipeline.context import FIELDS, RequestContext
from pipeline.protocols import Catalog
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.template import Template, compile_template
from stages.prompt import template_issues

_BREAKS = (re.compile(r"\n\s*\n"), re.compile(r"(?<=[.!?])\s+"), re.compile(r"\s+"))


class SplitConfig(NoConfig):
    #: The text to split (a template).
    text: str = "{{ input }}"
    #: The most characters a chunk holds.
    chunk_chars: int = Field(1500, ge=50, le=100_000)
    #: How many characters a chunk repeats from the end of the one before.
    overlap_chars: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _overlap_below_chunk(self) -> SplitConfig:
        if self.overlap_chars >= self.chunk_chars // 2:
            raise ValueError(f"overlap_chars must be under half of chunk_chars ({self.chunk_chars // 2})")
        return self

    @cached_property
    def compiled(self) -> Template:
        return compile_template(self.text)


@dataclass(slots=True)
class SplitOutputs:
    #: The chunks, in order.
    chunks: list[str]


class SplitStage(Stage):
    """Splits a text in chunks (see the module docstring)."""

    type_name = "split"
    Config = SplitConfig
    Outputs = SplitOutputs

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        return cast(SplitConfig, config).compiled.names & FIELDS.keys()

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        return template_issues(lambda: {"text": cast(SplitConfig, config).compiled})

    @classmethod
    def templates(cls, config: BaseModel) -> dict[tuple[str | int, ...], Template]:
        return {("text",): cast(SplitConfig, config).compiled}

    async def run(self, ctx: RequestContext, scope: StageScope) -> SplitOutputs:
        config = cast(SplitConfig, self.config)
        text = config.compiled.render({name: ctx.field_value(name) for name in config.compiled.names})
        chunks = split_text(text, config.chunk_chars, config.overlap_chars)
        scope.set_attribute("inferline.split.chunks", len(chunks))
        return SplitOutputs(chunks)


def split_text(text: str, size: int, overlap: int = 0) -> list[str]:
    """*text* in chunks of at most *size* characters (see the module docstring)."""
    chunks: list[str] = []
    start, text = 0, text.strip()
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            end = _cut(text, start, end)
        chunk = text[start:end].strip()
        if chunk:
            chunks.append(chunk)
        if end >= len(text):
            break
        start = max(end - overlap, start + 1) if overlap else end
    return chunks


def _cut(text: str, start: int, end: int) -> int:
    """Where to end a chunk of text[start:end]: after the last break of the strongest kind in its second half."""
    window = text[start:end]
    for pattern in _BREAKS:
        found = [m.end() for m in pattern.finditer(window) if m.start() >= len(window) // 2]
        if found:
            return start + found[-1]
    return end
