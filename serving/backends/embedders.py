"""The server's sentence-embedding models (``embedding_models:``), as the ``embed`` stage reaches them.

:class:`EmbedderPool` is the stage's :class:`~pipeline.protocols.EmbedderProvider`: it loads a model on
first use (or when the runtime starts, for the models its pipelines name), from the bundled
all-MiniLM-L6-v2 or a local folder, never from the network. :class:`LocalEmbedder` encodes in a worker
thread, in batches of the model's ``batch_size``, so the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from pipeline.errors import BackendError, InvalidInput
from pipeline.protocols import Embeddings
from serving.backends.tokenizer import HFTokenizer
from serving.config.models import EmbeddingModelSpec
from serving.config.server import ServerSpec
from store.embeddings import DEFAULT_MODEL, Embedder

logger = logging.getLogger(__name__)


class LocalEmbedder:
    """One sentence-transformers model in this process (:class:`~pipeline.protocols.EmbeddingBackend`)."""

    def __init__(self, name: str, embedder: Embedder):
        self.name = name
        self.embedder = embedder
        self.dimensions = embedder.dim
        self.max_input_tokens = embedder.max_tokens
        #: Its own tokenizer (``POST /tokenize`` on an embeddings pipeline counts with it).
        self.tokenizer = HFTokenizer(embedder.tokenizer)

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        return await asyncio.to_thread(self._embed, list(texts))

    def _embed(self, texts: list[str]) -> Embeddings:
        lengths = self.embedder.input_lengths(texts)
        for index, length in enumerate(lengths):
            if length > self.max_input_tokens:
                raise InvalidInput(f"input[{index}]: {length} tokens, over the {self.max_input_tokens} that "
                                   f"embedding model {self.name!r} reads; split the text")
        return Embeddings(self.embedder.encode(texts), tuple(lengths))


class EmbedderPool:
    """The embedding models of a server config, each loaded once, on first use or by :meth:`start`."""

    def __init__(self, server: ServerSpec, root: Path):
        self._specs = server.embedding_models
        self._root = root
        self._loaded: dict[str, LocalEmbedder] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, name: str) -> LocalEmbedder:
        backend = self._loaded.get(name)
        if backend is not None:
            return backend
        spec = self._specs.get(name)
        if spec is None:
            raise BackendError(f"no embedding model {name!r} (embedding_models: {', '.join(self._specs) or 'none'})")
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name not in self._loaded:
                self._loaded[name] = await asyncio.to_thread(self._load, name, spec)
        return self._loaded[name]

    async def start(self, names: Iterable[str]) -> None:
        """Load *names* now (those a runtime's pipelines use), so that the first request does not wait."""
        for name in sorted(set(names)):
            await self.get(name)

    def _load(self, name: str, spec: EmbeddingModelSpec) -> LocalEmbedder:
        source = spec.source if spec.source == DEFAULT_MODEL else str(self._root / spec.source)
        try:
            embedder = Embedder(source, spec.device, spec.batch_size)
        except (OSError, ValueError) as exc:
            raise BackendError(f"embedding model {name!r} did not load: {exc}") from exc
        logger.info("embedding model %s loaded (%s, %d dimensions, on %s)", name, spec.source, embedder.dim,
                    embedder.model.device)
        return LocalEmbedder(name, embedder)
