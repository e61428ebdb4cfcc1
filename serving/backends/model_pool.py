"""The model pool: each configured model's engine, started on first use and shared by every pipeline.

Local models run :class:`LocalEngine` replicas (``replicas: N`` runs N independent engines, each with
its own step thread, scheduler and KV cache, and its own ``kv_cache.memory_gb``; they share one copy of
the weights, which the forward pass only reads). Remote models (``backend: openai``) come from
:func:`serving.backends.remote.open_remote`, Ray models from :mod:`serving.backends.ray_engine`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry

from pipeline.errors import BackendError
from pipeline.protocols import Engine, ModelOccupancy
from serving.backends.engine_config import engine_config
from serving.backends.local_engine import LocalEngine, replica_name
from serving.backends.placement import Placement
from serving.backends.weights import weights_sha256
from serving.config.models import ModelSpec
from serving.config.server import ServerSpec
from serving.engine.async_engine import AsyncEngine
from serving.engine.errors import EngineError
from serving.engine.models import load_model

logger = logging.getLogger(__name__)


class PooledEngine(Engine, Protocol):
    """A started model as the pool keeps it: a :class:`LocalEngine`, a remote engine (a ChatEngine) or a Ray
    engine. Beyond the pipeline's Engine, the pool reads how busy it is and closes it."""

    def occupancy(self) -> ModelOccupancy: ...

    async def aclose(self) -> None: ...


class ModelPool:
    """Starts each configured model's engine on first use: local replicas, or a remote client."""

    def __init__(self, server: ServerSpec, root: Path = Path("."), registry: CollectorRegistry | None = None):
        self._specs = server.models
        self._root = root
        #: Where the server listens: what a remote model with ``base_url: self`` calls.
        self._http = server.http
        self._registry = registry
        #: Started models by name.
        self._engines: dict[str, PooledEngine] = {}
        self._lock = asyncio.Lock()
        self.default_model = next(iter(server.models), "")

    async def get(self, name: str) -> Engine:
        """Model *name*'s engine, started on first use (a ChatEngine for ``backend: openai``); raises
        BackendError for a name inferline.yaml does not have or a model that fails to start."""
        if name in self._engines:
            return self._engines[name]
        async with self._lock:
            if name not in self._engines:
                self._engines[name] = await self._start(name)
        return self._engines[name]

    def occupancy(self, name: str) -> ModelOccupancy:
        """How busy model *name* is now, without I/O; a model not started yet is idle."""
        engine = self._engines.get(name)
        return ModelOccupancy() if engine is None else engine.occupancy()

    async def _start(self, name: str) -> PooledEngine:
        spec = self._specs.get(name)
        if spec is None:
            raise BackendError(f"no model {name!r} in inferline.yaml (models: {', '.join(self._specs) or 'none'})")
        if spec.backend == "openai":
            return self._open_remote(name, spec)
        if spec.backend == "ray":
            return await self._open_ray(name, spec)
        return await self._start_local(name, spec)

    def _open_remote(self, name: str, spec: ModelSpec) -> PooledEngine:
        from serving.backends.remote import open_remote  # httpx's client: only remote models need it

        engine = open_remote(name, spec, self._root, served=self._http)
        logger.info("model %s: remote backend %s", name, engine.base_url)
        return engine

    async def _open_ray(self, name: str, spec: ModelSpec) -> PooledEngine:
        try:
            from serving.backends.ray_engine import open_ray_engine  # Ray: only ray models need it
        except ImportError as exc:
            raise BackendError(f"model {name!r}: backend: ray needs Ray Serve (pip install 'inferline[ray]')") from exc
        return await open_ray_engine(name, spec, self._root)

    async def _start_local(self, name: str, spec: ModelSpec) -> LocalEngine:
        draft = spec.speculative.draft_model if spec.speculative else None
        config = engine_config(spec, self._root, self._specs[draft] if draft else None)
        replicas: list[AsyncEngine] = []
        try:
            # Several replicas share one copy of the weights, loaded here once; a single replica loads its own.
            loaded = None
            if spec.replicas > 1:
                loaded = await asyncio.to_thread(load_model, config.model, config.dtype, config.device)
            for index in range(spec.replicas):
                replicas.append(AsyncEngine(config, name=replica_name(name, index),
                                            metrics_registry=self._registry, loaded=loaded))
                await replicas[-1].start()
        except EngineError as exc:
            for replica in replicas:
                await replica.shutdown()
            raise BackendError(f"model {name!r} failed to start: {exc}") from exc
        weights_hash = await asyncio.to_thread(weights_sha256, Path(config.model))
        logger.info("model %s started: %d replica(s), weights sha256 %s", name, spec.replicas, weights_hash[:12])
        placement = Placement(spec.replicas, spec.placement, config.block_size, max_imbalance=spec.max_imbalance)
        return LocalEngine(name, replicas, weights_hash, placement)

    async def start_all(self) -> None:
        """Start every local model now (the server does, so that it is ready when it says so)."""
        for name, spec in self._specs.items():
            if spec.backend == "local":
                await self.get(name)

    def engines(self) -> dict[str, AsyncEngine]:
        """Every local replica by name (``model``, ``model#1``...), for metrics and readiness."""
        out: dict[str, AsyncEngine] = {}
        for engine in self._engines.values():
            if isinstance(engine, LocalEngine):
                out.update(engine.named_replicas())
        return out

    async def close(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            await engine.aclose()
