"""Change notices on the real PostgreSQL: a notice wakes the listeners of its own schema only; on SQLite
nothing is sent and nothing listens (the processes poll)."""

from __future__ import annotations

import asyncio

import pytest

from store.engine import make_engine
from store.notify import announce, listen
from tests.postgres import fresh_schema_url


def test_sqlite_sends_nothing_and_listens_to_nothing(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    announce(engine)  # no error, nothing to send
    assert asyncio.run(asyncio.wait_for(listen(engine, lambda: None), 1)) is None  # returns at once


@pytest.mark.integration
def test_a_notice_wakes_the_listeners_of_its_schema_only():
    async def scenario(mine_url: str, other_url: str) -> tuple[int, int]:
        mine, other = make_engine(mine_url), make_engine(other_url)
        woken = {"mine": 0, "other": 0}

        def wake(which: str):
            return lambda: woken.__setitem__(which, woken[which] + 1)

        listeners = [asyncio.create_task(listen(mine, wake("mine"))),
                     asyncio.create_task(listen(other, wake("other")))]
        try:
            for _ in range(100):  # until both listen: a notice sent before LISTEN is not received
                await asyncio.to_thread(announce, mine)
                await asyncio.to_thread(announce, other)
                await asyncio.sleep(0.05)
                if woken["mine"] and woken["other"]:
                    break
            await asyncio.sleep(0.3)  # the notices of the last round land
            before = dict(woken)
            for _ in range(3):
                await asyncio.to_thread(announce, mine)
            for _ in range(100):
                if woken["mine"] >= before["mine"] + 3:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            return woken["mine"] - before["mine"], woken["other"] - before["other"]
        finally:
            for task in listeners:
                task.cancel()
            await asyncio.gather(*listeners, return_exceptions=True)
            mine.dispose()
            other.dispose()

    with fresh_schema_url() as mine_url, fresh_schema_url() as other_url:
        assert asyncio.run(scenario(mine_url, other_url)) == (3, 0)
