"""Local model engines behind the pipeline's ``EngineProvider`` protocol.

One engine per configured model, started on first use and shared by every
pipeline of the process. This is where the engine's own errors become the
pipeline's (``Overloaded``, ``InvalidInput``, ``BackendError``), since the
engine imports nothing of ours.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from prometheus_client import CollectorRegistry

from pipeline.errors import BackendError, InvalidInput, Overloaded
from pipeline.protocols import SamplingParams, TokenEvent
from pipeline.spec import ModelSpec, ServerSpec
from serving.engine.async_engine import AsyncEngine, RequestStream
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError, EngineOverloaded, InvalidRequest
from serving.engine.sampling_params import SamplingParams as EngineSampling

logger = logging.getLogger(__name__)


class HFTokenizer:
    """The pipeline's Tokenizer protocol over a transformers tokenizer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        ids = self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


class _Stream:
    """An engine stream whose errors are the pipeline's."""

    def __init__(self, stream: RequestStream, model: str):
        self._stream, self._model = stream, model

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        try:
            async for event in self._stream:
                yield event
        except EngineError as exc:
            raise BackendError(f"model {self._model!r}: {exc}") from exc

    async def aclose(self) -> None:
        await self._stream.aclose()


class LocalEngine:
    """The pipeline's Engine protocol over one :class:`AsyncEngine`."""

    def __init__(self, name: str, engine: AsyncEngine, weights_hash: str):
        self.name, self.engine = name, engine
        self.tokenizer = HFTokenizer(engine.tokenizer)
        self.weights_hash = weights_hash

    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str = "") -> _Stream:
        try:
            stream = await self.engine.submit(prompt_ids, EngineSampling(**asdict(sampling)), cache_salt)
        except EngineOverloaded as exc:
            raise Overloaded(f"model {self.name!r} is overloaded: {exc}", exc.retry_after_s) from exc
        except InvalidRequest as exc:
            raise InvalidInput(str(exc)) from exc
        except EngineError as exc:
            raise BackendError(f"model {self.name!r}: {exc}") from exc
        return _Stream(stream, self.name)


class ModelPool:
    """Starts each configured local model's engine on first use; one per model."""

    def __init__(self, server: ServerSpec, root: Path = Path("."), registry: CollectorRegistry | None = None):
        self._specs = server.models
        self._root = root
        self._registry = registry
        self._engines: dict[str, LocalEngine] = {}
        self._lock = asyncio.Lock()
        self.default_model = next(iter(server.models), "")

    async def get(self, name: str) -> LocalEngine:
        if name in self._engines:
            return self._engines[name]
        async with self._lock:
            if name not in self._engines:
                self._engines[name] = await self._start(name)
        return self._engines[name]

    async def _start(self, name: str) -> LocalEngine:
        spec = self._specs.get(name)
        if spec is None:
            raise BackendError(f"no model {name!r} in inferline.yaml (models: {', '.join(self._specs) or 'none'})")
        if spec.backend != "local":
            raise BackendError(f"model {name!r}: backend {spec.backend!r} is not available yet")
        config = engine_config(spec, self._root)
        engine = AsyncEngine(config, name=name, metrics_registry=self._registry)
        try:
            await engine.start()
        except EngineError as exc:
            raise BackendError(f"model {name!r} failed to start: {exc}") from exc
        weights_hash = await asyncio.to_thread(weights_sha256, Path(config.model))
        logger.info("model %s started (weights sha256 %s)", name, weights_hash[:12])
        return LocalEngine(name, engine, weights_hash)

    async def start_all(self) -> None:
        """Start every local model now (the server does, so that it is ready when it says so)."""
        for name, spec in self._specs.items():
            if spec.backend == "local":
                await self.get(name)

    def engines(self) -> dict[str, AsyncEngine]:
        return {name: local.engine for name, local in self._engines.items()}

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.engine.shutdown()
        self._engines.clear()


def weights_sha256(source: Path) -> str:
    """SHA-256 over the weight files of *source* (a .gguf file or a folder's safetensors, in name order)."""
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def engine_config(spec: ModelSpec, root: Path) -> EngineConfig:
    """The engine options for a model of ``inferline.yaml`` (resolving ``auto``)."""
    import torch

    if spec.source is None:
        raise BackendError("a local model needs source: (an HF folder or a .gguf file)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device
    dtype = spec.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if dtype == "int8":
        raise BackendError("dtype int8 (weight-only quantization) is not available yet; use float32")
    kv = spec.kv_cache
    return EngineConfig(
        model=str(root / spec.source), dtype=dtype, device=device, block_size=kv.block_size,
        num_blocks=None if kv.max_blocks == "auto" else kv.max_blocks,
        kv_cache_bytes=int(kv.memory_gb * (1 << 30)), enable_prefix_caching=kv.prefix_cache,
        max_num_seqs=spec.batching.max_num_seqs, max_num_batched_tokens=spec.batching.max_num_batched_tokens,
        max_waiting=spec.batching.max_waiting, max_model_len=spec.context_window,
    )
