"""The server's cross-encoder rerankers (``rerankers:`` of type ``cross_encoder``), as ``retrieve`` reaches them.

:class:`RerankerPool` is the stage's :class:`~pipeline.protocols.RerankerProvider`: it loads a
sentence-transformers ``CrossEncoder`` from its local folder on first use (never from the network) and keeps
it. :class:`CrossEncoderReranker` scores (question, passage) pairs in a worker thread, in batches, so the
event loop keeps serving meanwhile. ``llm`` rerankers need no loading: the stage asks their model's engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import BackendError
from serving.config.server import RerankerSpec, ServerSpec

logger = logging.getLogger(__name__)


class CrossEncoderReranker:
    """One CrossEncoder in this process (:class:`~pipeline.protocols.Reranker`)."""

    def __init__(self, name: str, model: Any, batch_size: int = 32):
        self.name = name
        self.model = model
        self.batch_size = batch_size
        self._lock = threading.Lock()

    @classmethod
    def load(cls, name: str, folder: Path, device: str = "auto", batch_size: int = 32) -> CrossEncoderReranker:
        """The CrossEncoder saved in *folder*; raises BackendError when it is not there or does not load."""
        import torch
        from sentence_transformers import CrossEncoder

        if not (folder / "config.json").is_file():
            raise BackendError(f"reranker {name!r}: no model at {folder} (a sentence-transformers CrossEncoder "
                               "folder with config.json; nothing is downloaded)")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model = CrossEncoder(str(folder), device=device, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise BackendError(f"reranker {name!r} did not load from {folder}: {exc}") from exc
        return cls(name, model, batch_size)

    async def score(self, query: str, passages: Sequence[str]) -> list[float]:
        return await asyncio.to_thread(self._score, query, list(passages))

    def _score(self, query: str, passages: list[str]) -> list[float]:
        if not passages:
            return []
        with self._lock:
            scores = self.model.predict([(query, p) for p in passages], batch_size=self.batch_size,
                                        show_progress_bar=False, convert_to_numpy=True)
        return [float(s) for s in scores.reshape(len(passages), -1)[:, -1]]


class RerankerPool:
    """The cross-encoder rerankers of a server config, each loaded once, on first use."""

    def __init__(self, server: ServerSpec, root: Path):
        self._specs = server.rerankers
        self._root = root
        self._loaded: dict[str, CrossEncoderReranker] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, name: str) -> CrossEncoderReranker:
        reranker = self._loaded.get(name)
        if reranker is not None:
            return reranker
        spec = self._specs.get(name)
        if spec is None or spec.type != "cross_encoder":
            known = sorted(n for n, s in self._specs.items() if s.type == "cross_encoder")
            raise BackendError(f"no cross-encoder reranker {name!r} (rerankers: {', '.join(known) or 'none'})")
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name not in self._loaded:
                self._loaded[name] = await asyncio.to_thread(self._load, name, spec)
        return self._loaded[name]

    def _load(self, name: str, spec: RerankerSpec) -> CrossEncoderReranker:
        reranker = CrossEncoderReranker.load(name, self._root / str(spec.source), spec.device, spec.batch_size)
        logger.info("reranker %s loaded (%s, on %s)", name, spec.source, reranker.model.device)
        return reranker
