"""The response caches the ``cache`` stage uses, from ``store``: memory or Redis, and MiniLM embeddings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from store.response_cache import MemoryCache, RedisCache, SemanticIndex


class StoreCaches:
    """``pipeline.protocols.CacheProvider`` over ``store.response_cache`` and ``store.embeddings``."""

    def open_cache(self, backend: str, *, redis_url: str, prefix: str, ttl_s: float, max_entries: int,
                   clock: Callable[[], float]) -> MemoryCache | RedisCache:
        if backend == "redis":
            return RedisCache(redis_url, prefix, ttl_s)
        return MemoryCache(max_entries, ttl_s, clock=clock)

    def open_semantic(self, max_entries: int, *, ttl_s: float, clock: Callable[[], float]) -> SemanticIndex:
        return SemanticIndex(max_entries, ttl_s=ttl_s, clock=clock)

    def embed(self, text: str) -> Any:
        from store.embeddings import shared_embedder  # torch: loaded on the first semantic lookup only

        return shared_embedder().encode([text])[0]
