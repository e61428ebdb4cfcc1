"""Response caches for the ``cache`` stage: exact answers in memory or in Redis, and a semantic index.

Both caches map a key (a hex digest) to a small JSON-able dict and expire
entries ``ttl_s`` seconds after they were set; neither ever raises on a
missing or expired key, it returns None.

    cache = MemoryCache(max_entries=10_000, ttl_s=3600)       # LRU beyond max_entries
    cache = RedisCache("redis://127.0.0.1:6379/0", prefix="inferline", ttl_s=3600)
    await cache.set(key, {"ids": [1, 2, 3], "finish_reason": "stop", "created": time.time()})
    await cache.get(key)                                     # the dict, or None

:class:`SemanticIndex` finds the stored entry whose vector is most similar to
a query vector (cosine similarity, brute force over at most ``max_entries``
unit vectors), within one scope.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from redis.asyncio import Redis

Clock = Callable[[], float]


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


class MemoryCache:
    """An in-process LRU cache with a TTL; thread-safe, O(1) per call.

    Values are kept as JSON text, so a caller that mutates what it stored or got
    back never changes the cache. *clock* (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, max_entries: int, ttl_s: float, *, clock: Clock = time.monotonic):
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("max_entries and ttl_s must be positive")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        # key -> (expires at, JSON text); least recently used first.
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    async def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[0] <= self.clock():
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            text = entry[1]
        return json.loads(text)

    async def set(self, key: str, value: dict[str, Any]) -> None:
        text = _dumps(value)
        with self._lock:
            self._entries[key] = (self.clock() + self.ttl_s, text)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        """Nothing to close."""


class RedisCache:
    """A cache in Redis, shared by every process that uses the same URL and prefix (``SET ... EX``)."""

    def __init__(self, url: str, prefix: str = "inferline", ttl_s: float = 3600):
        # Short timeouts: a Redis that does not answer costs a request 2 s at most, then it is a miss.
        self.client = Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.prefix = prefix
        self.ttl_s = max(1, math.ceil(ttl_s))  # EX takes whole seconds

    async def get(self, key: str) -> dict[str, Any] | None:
        raw = await self.client.get(self._key(key))
        return None if raw is None else json.loads(raw)

    async def set(self, key: str, value: dict[str, Any]) -> None:
        await self.client.set(self._key(key), _dumps(value), ex=self.ttl_s)

    async def ping(self) -> None:
        await self.client.ping()

    async def close(self) -> None:
        await self.client.aclose()

    def _key(self, key: str) -> str:
        return f"{self.prefix}:cache:{key}"


class SemanticIndex:
    """Entries with a unit vector and a scope; :meth:`search` finds the most similar one in a scope.

    The vectors live in one preallocated ``(max_entries, dim)`` matrix (``dim`` set by the
    first vector); a search is one matrix-vector product. When full, the least recently
    used entry (added or found) makes room. Entries older than *ttl_s* no longer match.
    """

    def __init__(self, max_entries: int, *, ttl_s: float | None = None, clock: Clock = time.monotonic):
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._vectors: np.ndarray | None = None
        self._scopes = np.empty(max_entries, dtype=object)
        self._expires = np.full(max_entries, np.inf)
        self._values: list[dict[str, Any] | None] = [None] * max_entries
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots in use, least recently used first
        self._lock = threading.Lock()

    def add(self, scope: str, vector: np.ndarray, value: dict[str, Any]) -> None:
        unit = self._unit(vector)
        with self._lock:
            if self._vectors is None:
                self._vectors = np.zeros((self.max_entries, unit.shape[0]), dtype=np.float32)
            if len(self._lru) < self.max_entries:
                slot = len(self._lru)  # slots fill in order and are only ever reused
            else:
                slot, _ = self._lru.popitem(last=False)
            self._vectors[slot] = unit
            self._scopes[slot] = scope
            self._expires[slot] = np.inf if self.ttl_s is None else self.clock() + self.ttl_s
            self._values[slot] = value
            self._lru[slot] = None

    def search(self, scope: str, vector: np.ndarray, threshold: float) -> tuple[float, dict[str, Any]] | None:
        """The best entry of *scope* with a cosine similarity of at least *threshold*, and that similarity."""
        unit = self._unit(vector)
        with self._lock:
            used = len(self._lru)
            if self._vectors is None or used == 0:
                return None
            scores = self._vectors[:used] @ unit
            live = (self._scopes[:used] == scope) & (self._expires[:used] > self.clock())
            scores = np.where(live, scores, -np.inf)
            slot = int(np.argmax(scores))
            score = float(scores[slot])
            if score < threshold:
                return None
            self._lru.move_to_end(slot)
            return score, self._values[slot]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._lru)

    def _unit(self, vector: np.ndarray) -> np.ndarray:
        vector = np.asarray(vector, dtype=np.float32).reshape(-1)
        if self._vectors is not None and vector.shape[0] != self._vectors.shape[1]:
            raise ValueError(f"vector of dimension {vector.shape[0]}, the index holds {self._vectors.shape[1]}")
        norm = float(np.linalg.norm(vector))
        if not norm or not math.isfinite(norm):
            raise ValueError("a zero or non-finite vector has no direction")
        return vector / norm
