"""Fixed-window counters for rate limits and budgets: in the SQL database, or in Redis.

Both implement ``pipeline.protocols.Counters``. A window of ``window_s``
seconds starts at a multiple of ``window_s`` since the epoch (a day window at
00:00 UTC), so every process agrees on it without coordination. ``consume``
is atomic in both: one SQL upsert whose update only applies under the limit,
or one Lua script in Redis.

    counters = SqlCounters(make_engine("sqlite:///inferline.db"))
    state = await counters.consume("chat:key:abc:requests", 1, limit=60, window_s=60)
    state.allowed, state.used, state.reset_s
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import sqlalchemy as sa
from redis.asyncio import Redis
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped, mapped_column

from store.db import Base

#: Windows older than this many seconds past their end are deleted (by the SQL store, now and then).
KEEP_EXPIRED_S = 86_400
#: The longest window in use (a day): a window that started before cutoff - this has surely ended.
DAY_MAX_S = 86_400
_PRUNE_EVERY = 1000


@dataclass(frozen=True, slots=True)
class Count:
    """A counter after a call (``pipeline.protocols.CounterState``)."""

    allowed: bool
    used: float
    reset_s: float
    window_start: int = 0


def window_of(window_s: int, now: float | None = None) -> tuple[int, float]:
    """The current window's start (epoch seconds) and the seconds left in it."""
    now = time.time() if now is None else now
    start = int(now // window_s) * window_s
    return start, start + window_s - now


class LimitCounter(Base):
    """One counter in one time window."""

    __tablename__ = "limit_counters"

    key: Mapped[str] = mapped_column(sa.String(300), primary_key=True)
    """What is counted, for whom: ``<pipeline>:<scope>:<subject>:<metric>``."""
    window_start: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    """Epoch seconds at which the window starts."""
    window_s: Mapped[int] = mapped_column(sa.Integer)
    value: Mapped[float] = mapped_column(sa.Float)
    """The total so far: requests, tokens or USD."""


class SqlCounters:
    """Counters in the server's own database (one machine, or several sharing one PostgreSQL)."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self._calls = 0

    async def consume(self, key: str, amount: float, limit: float, window_s: int) -> Count:
        return await asyncio.to_thread(self._consume, key, amount, limit, window_s)

    async def add(self, key: str, amount: float, window_s: int, window_start: int | None = None) -> None:
        await asyncio.to_thread(self._consume, key, amount, float("inf"), window_s, window_start)

    async def get(self, key: str, window_s: int) -> Count:
        return await asyncio.to_thread(self._get, key, window_s)

    async def close(self) -> None:
        """Nothing to close: the database engine belongs to the caller."""

    def _consume(self, key: str, amount: float, limit: float, window_s: int,
                 window_start: int | None = None) -> Count:
        start, reset_s = window_of(window_s)
        start = start if window_start is None else window_start
        if amount > limit:
            return Count(False, self._value(key, start), reset_s, start)
        table = LimitCounter.__table__
        insert = (postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert)(table)
        statement = insert.values(key=key, window_start=start, window_s=window_s, value=amount)
        # The update applies only under the limit: check and add are one atomic statement.
        statement = statement.on_conflict_do_update(
            index_elements=["key", "window_start"], set_={"value": table.c.value + amount},
            where=(table.c.value + amount <= limit) if limit != float("inf") else None,
        ).returning(table.c.value)
        with self.engine.begin() as conn:
            row = conn.execute(statement).first()
        self._prune()
        if row is None:
            return Count(False, self._value(key, start), reset_s, start)
        return Count(True, float(row[0]), reset_s, start)

    def _get(self, key: str, window_s: int) -> Count:
        start, reset_s = window_of(window_s)
        return Count(True, self._value(key, start), reset_s, start)

    def _value(self, key: str, start: int) -> float:
        table = LimitCounter.__table__
        with self.engine.connect() as conn:
            value = conn.execute(sa.select(table.c.value).where(table.c.key == key,
                                                                table.c.window_start == start)).scalar()
        return float(value or 0.0)

    def _prune(self) -> None:
        """Now and then, in its own short transaction: delete windows that ended a day ago."""
        self._calls += 1
        if self._calls % _PRUNE_EVERY:
            return
        table = LimitCounter.__table__
        cutoff = time.time() - KEEP_EXPIRED_S
        with self.engine.begin() as conn:
            conn.execute(sa.delete(table).where(table.c.window_start < cutoff - DAY_MAX_S))


# KEYS[1] counter; ARGV amount, limit (or "inf"), ttl seconds. Returns {allowed, total}.
_CONSUME = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local amount = tonumber(ARGV[1])
if ARGV[2] ~= 'inf' and used + amount > tonumber(ARGV[2]) then
  return {0, tostring(used)}
end
local total = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, total}
"""


class RedisCounters:
    """Counters in Redis, so that several server processes (or machines) share one limit."""

    def __init__(self, url: str, prefix: str = "inferline"):
        # Short timeouts: a Redis that does not answer gives 503s, not requests that hang.
        self.client = Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.prefix = prefix
        self._script = self.client.register_script(_CONSUME)

    async def consume(self, key: str, amount: float, limit: float, window_s: int,
                      window_start: int | None = None) -> Count:
        start, reset_s = window_of(window_s)
        start = start if window_start is None else window_start
        ttl = int(reset_s) + 60
        allowed, total = await self._script(keys=[self._key(key, start)],
                                            args=[repr(float(amount)), "inf" if limit == float("inf")
                                                  else repr(float(limit)), ttl])
        return Count(bool(int(allowed)), float(total), reset_s, start)

    async def add(self, key: str, amount: float, window_s: int, window_start: int | None = None) -> None:
        await self.consume(key, amount, float("inf"), window_s, window_start)

    async def get(self, key: str, window_s: int) -> Count:
        start, reset_s = window_of(window_s)
        value = await self.client.get(self._key(key, start))
        return Count(True, float(value or 0.0), reset_s, start)

    async def ping(self) -> None:
        await self.client.ping()

    async def close(self) -> None:
        await self.client.aclose()

    def _key(self, key: str, start: int) -> str:
        return f"{self.prefix}:limits:{key}:{start}"
