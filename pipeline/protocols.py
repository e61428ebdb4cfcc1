"""The small protocols through which stages reach the world.

Stages never import the engine, the vector store or the audit database. They
see these protocols; ``serving`` wires real implementations in, and unit tests
pass fakes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline.cost import Price


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the loader and the stages may know of a model without loading it."""

    name: str
    price: Price = field(default_factory=Price)
    context_window: int | None = None


@dataclass(frozen=True, slots=True)
class Catalog:
    """Names a pipeline may refer to, checked at load time."""

    models: Mapping[str, ModelInfo] = field(default_factory=dict)
    indexes: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample; what ``generate`` hands the engine."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back, with the model's chat template."""

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@runtime_checkable
class Engine(Protocol):
    """A batched generator of tokens for one model."""

    tokenizer: Tokenizer

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncIterator[int]:
        """Start generating; cancelling the iterator frees the request's resources."""
        ...


@runtime_checkable
class VectorIndex(Protocol):
    """Nearest-neighbour search over embedded documents."""

    name: str
    version: str

    def search(self, query: str, top_k: int) -> list[tuple[str, float]]: ...


@runtime_checkable
class AuditSink(Protocol):
    """Where audit records go; must never lose one."""

    async def write(self, record: Mapping[str, Any]) -> None: ...


@dataclass(slots=True)
class Resources:
    """The live objects a pipeline's stages use, wired in by ``serving``."""

    catalog: Catalog = field(default_factory=Catalog)
    engines: Mapping[str, Engine] = field(default_factory=dict)
    indexes: Mapping[str, VectorIndex] = field(default_factory=dict)
    audit: AuditSink | None = None
