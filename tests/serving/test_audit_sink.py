"""StoreSink's group commit: records that arrive together share a transaction."""

from __future__ import annotations

import asyncio
from typing import Any

from serving.audit_sink import StoreSink
from store.audit import AuditStore
from store.audit_query import AuditFilters


class _Batches:
    """Records each batch's size; stands in for the store in this unit test of the sink."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def awrite_batch(self, records: list[dict[str, Any]]) -> list[str]:
        self.sizes.append(len(records))
        await asyncio.sleep(0.01)  # a commit takes a while
        return [str(i) for i in range(len(records))]


async def test_records_arriving_during_a_commit_go_together_in_the_next():
    store = _Batches()
    sink = StoreSink(store)  # type: ignore[arg-type]

    async def later() -> None:
        await asyncio.sleep(0.005)  # during the first commit
        await sink.write({"status": "ok"})

    await asyncio.gather(sink.write({"status": "ok"}), *(later() for _ in range(5)))
    assert store.sizes == [1, 5]


async def test_every_record_of_a_burst_lands_in_one_chain(tmp_path):
    from store.db import create_schema, make_engine

    database = make_engine(f"sqlite:///{tmp_path / 'audit.db'}")
    create_schema(database)
    store = AuditStore(database, spool_path=tmp_path / "spool.jsonl")
    sink = StoreSink(store)
    await asyncio.gather(*(sink.write({"request_id": f"r{i}", "pipeline": "chat", "status": "ok"})
                           for i in range(20)))
    report = store.verify()
    assert report.ok and report.checked == 20
    page = store.query(AuditFilters(pipeline="chat"), limit=50)
    assert sorted(r["request_id"] for r in page.records) == sorted(f"r{i}" for i in range(20))
