"""The response caches (memory LRU + TTL, real Redis) and the semantic index, with handmade vectors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from store.response_cache import MemoryCache, RedisCache, SemanticIndex


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def entry(n: int) -> dict:
    return {"ids": [n, n + 1], "finish_reason": "stop", "created": 0.0}


# --- memory ----------------------------------------------------------------------


async def test_memory_cache_round_trips_json_values_as_copies():
    cache = MemoryCache(10, 60)
    await cache.set("k", entry(1))
    got = await cache.get("k")
    assert got == entry(1)
    got["ids"].append(99)  # the caller's copy: the cache keeps its own
    assert await cache.get("k") == entry(1)
    assert await cache.get("missing") is None


async def test_memory_cache_evicts_the_least_recently_used():
    cache = MemoryCache(2, 60)
    await cache.set("a", entry(1))
    await cache.set("b", entry(2))
    assert await cache.get("a") is not None  # a is now more recent than b
    await cache.set("c", entry(3))
    assert len(cache) == 2
    assert await cache.get("b") is None
    assert await cache.get("a") == entry(1) and await cache.get("c") == entry(3)
    await cache.set("a", entry(4))  # overwriting refreshes, never grows
    assert len(cache) == 2 and await cache.get("a") == entry(4)


async def test_memory_cache_entries_expire_after_ttl():
    clock = FakeClock()
    cache = MemoryCache(10, 30, clock=clock)
    await cache.set("k", entry(1))
    clock.now += 29.9
    assert await cache.get("k") == entry(1)  # a hit does not extend the TTL
    clock.now += 0.1
    assert await cache.get("k") is None
    assert len(cache) == 0  # dropped once seen expired
    await cache.set("k", entry(2))  # set again: a fresh TTL
    clock.now += 29
    assert await cache.get("k") == entry(2)


def test_memory_cache_refuses_nonsense_sizes():
    with pytest.raises(ValueError):
        MemoryCache(0, 60)
    with pytest.raises(ValueError):
        MemoryCache(10, 0)


# --- Redis -----------------------------------------------------------------------


@pytest.fixture
async def redis_cache(redis_url, redis_prefix) -> AsyncIterator[RedisCache]:
    cache = RedisCache(redis_url, prefix=redis_prefix, ttl_s=30.5)
    yield cache
    await cache.close()


@pytest.mark.integration
async def test_redis_cache_round_trips_with_an_expiry(redis_cache):
    assert await redis_cache.get("k") is None
    await redis_cache.set("k", entry(1))
    assert await redis_cache.get("k") == entry(1)
    ttl = await redis_cache.client.ttl(f"{redis_cache.prefix}:cache:k")
    assert 0 < ttl <= 31  # whole seconds, rounded up
    await redis_cache.set("k", entry(2))
    assert await redis_cache.get("k") == entry(2)


@pytest.mark.integration
async def test_redis_caches_with_other_prefixes_do_not_see_each_other(redis_cache, redis_url):
    other = RedisCache(redis_url, prefix=f"{redis_cache.prefix}-other", ttl_s=30)
    try:
        await redis_cache.set("k", entry(1))
        assert await other.get("k") is None
    finally:
        await other.close()


async def test_an_unreachable_redis_raises_promptly():
    cache = RedisCache("redis://127.0.0.1:1/0", ttl_s=30)  # nothing listens on port 1
    try:
        with pytest.raises(RedisConnectionError):
            await cache.get("k")
    finally:
        await cache.close()


# --- semantic index --------------------------------------------------------------


def vec(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def test_semantic_index_matches_at_or_above_the_threshold_only():
    index = SemanticIndex(10)
    index.add("s", vec(1, 0, 0), entry(1))
    index.add("s", vec(0, 1, 0), entry(2))
    score, value = index.search("s", vec(0.95, 0.3122, 0), 0.92)  # cos = 0.95 with the first
    assert value == entry(1) and score == pytest.approx(0.95, abs=1e-3)
    assert index.search("s", vec(0.8, 0.6, 0), 0.92) is None  # cos 0.8: below
    assert index.search("s", vec(0.8, 0.6, 0), 0.8 - 1e-6)[1] == entry(1)  # at the threshold: a hit
    assert index.search("s", vec(5, 0, 0), 0.99)[1] == entry(1)  # length does not matter
    assert index.search("s", vec(0, 0, 1), 0.1) is None


def test_semantic_index_scopes_are_separate():
    index = SemanticIndex(10)
    index.add("tenant-a", vec(1, 0), entry(1))
    assert index.search("tenant-b", vec(1, 0), 0.5) is None
    index.add("tenant-b", vec(0.9, 0.1), entry(2))
    assert index.search("tenant-a", vec(0.9, 0.1), 0.5)[1] == entry(1)
    assert index.search("tenant-b", vec(1, 0), 0.5)[1] == entry(2)


def test_semantic_index_evicts_the_least_recently_used():
    index = SemanticIndex(2)
    index.add("s", vec(1, 0, 0), entry(1))
    index.add("s", vec(0, 1, 0), entry(2))
    assert index.search("s", vec(1, 0, 0), 0.9) is not None  # the first is now the more recent
    index.add("s", vec(0, 0, 1), entry(3))
    assert len(index) == 2
    assert index.search("s", vec(0, 1, 0), 0.9) is None
    assert index.search("s", vec(1, 0, 0), 0.9)[1] == entry(1)
    assert index.search("s", vec(0, 0, 1), 0.9)[1] == entry(3)


def test_semantic_index_entries_expire():
    clock = FakeClock()
    index = SemanticIndex(4, ttl_s=10, clock=clock)
    index.add("s", vec(1, 0), entry(1))
    clock.now += 9
    assert index.search("s", vec(1, 0), 0.9) is not None
    clock.now += 1
    assert index.search("s", vec(1, 0), 0.9) is None


def test_semantic_index_refuses_bad_vectors():
    index = SemanticIndex(4)
    assert index.search("s", vec(1, 0), 0.5) is None  # empty
    index.add("s", vec(1, 0), entry(1))
    with pytest.raises(ValueError, match="dimension"):
        index.search("s", vec(1, 0, 0), 0.5)
    with pytest.raises(ValueError, match="direction"):
        index.add("s", vec(0, 0), entry(2))
