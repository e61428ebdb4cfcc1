"""The rate-limit and budget counters against real SQLite, PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from store.counters import RedisCounters, SqlCounters, window_of


@pytest.fixture
async def redis_counters(redis_url, redis_prefix) -> AsyncIterator[RedisCounters]:
    counters = RedisCounters(redis_url, prefix=redis_prefix)
    yield counters
    await counters.close()


@pytest.fixture(params=["sql", pytest.param("redis", marks=pytest.mark.integration)])
def counters(request, engine):
    # `engine` is itself parametrised (SQLite, PostgreSQL); Redis runs once per database, harmlessly.
    if request.param == "sql":
        return SqlCounters(engine)
    return request.getfixturevalue("redis_counters")


def test_windows_start_at_multiples_of_their_length():
    assert window_of(60, now=125.5) == (120, 54.5)
    assert window_of(86_400, now=86_400 * 3 + 10) == (86_400 * 3, 86_390)


async def test_consume_stops_at_the_limit_and_get_reports(counters, fresh_minute):
    states = [await counters.consume("p:key:a:requests", 1, 3, 60) for _ in range(4)]
    assert [s.allowed for s in states] == [True, True, True, False]
    assert [s.used for s in states] == [1, 2, 3, 3]
    assert 0 < states[0].reset_s <= 60
    assert (await counters.get("p:key:a:requests", 60)).used == 3
    assert (await counters.get("p:key:b:requests", 60)).used == 0  # keys are separate


async def test_an_amount_over_the_limit_is_refused_even_on_an_empty_counter(counters):
    state = await counters.consume("p:key:a:tokens", 150, 100, 86_400)
    assert not state.allowed and state.used == 0


async def test_add_gives_back_and_ignores_the_limit(counters):
    await counters.consume("p:key:a:tokens", 80, 100, 86_400)
    await counters.add("p:key:a:tokens", -30, 86_400)
    assert (await counters.get("p:key:a:tokens", 86_400)).used == 50
    await counters.add("p:key:a:cost", 0.25, 86_400)
    await counters.add("p:key:a:cost", 0.5, 86_400)
    assert (await counters.get("p:key:a:cost", 86_400)).used == pytest.approx(0.75)


async def test_concurrent_consumers_never_pass_the_limit(counters, fresh_minute):
    states = await asyncio.gather(*(counters.consume("p:key:race:requests", 1, 10, 60) for _ in range(30)))
    assert sum(s.allowed for s in states) == 10
    assert (await counters.get("p:key:race:requests", 60)).used == 10
