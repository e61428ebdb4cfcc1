"""A serving process's seal: the chain head signed every few seconds whoever appended the records (a
process without the key too), the checkpoints delivered as digests, and a last round at shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from serving.backends.anchor_delivery import AnchorDelivery
from serving.backends.audit_seal import AuditSeal
from store.audit import Anchors, AuditStore, verify_anchors
from store.engine import make_engine
from store.migrate import create_schema
from tests.store.audit.test_anchors import SIGNER, public_only
from tests.store.audit.test_store import make_record
from tests.store.audit.test_tail import checkpoints


@pytest.fixture
def stores(tmp_path) -> Iterator[tuple[AuditStore, AuditStore]]:
    """The server's store (with the key) and one of ``inferline run`` (without), on one SQLite file."""
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    create_schema(engine)
    yield (AuditStore(engine, spool_path=tmp_path / "server.spool", checkpoint_key=SIGNER),
           AuditStore(engine, spool_path=tmp_path / "run.spool"))
    engine.dispose()


def test_a_keyless_process_s_records_are_sealed_at_start_and_at_shutdown(stores, tmp_path):
    server, run = stores
    delivery = AnchorDelivery(Anchors(server.engine, tmp_path / "digests", SIGNER), url=None, every_s=3600)
    registry = CollectorRegistry()
    seal = AuditSeal(server, every_s=3600, delivery=delivery, registry=registry)  # rounds: start and close only

    async def serve() -> None:
        for i in range(3):
            run.write(make_record(i))  # left before the server started (a journal chained at start, say)
        await seal.start()
        assert checkpoints(server.engine) == [3] and (tmp_path / "digests" / f"{3:020d}.json").exists()
        for i in range(3, 5):
            run.write(make_record(i))  # while it serves
        await seal.aclose()  # after the sink's last record

    asyncio.run(serve())
    assert checkpoints(server.engine) == [3, 5]
    assert registry.get_sample_value("inferline_audit_checkpointed_seq") == 5
    anchored = verify_anchors(server.engine, tmp_path / "digests", public_only())
    assert anchored.ok and anchored.anchored_seq == 5 and anchored.unanchored is None


def test_rounds_run_every_few_seconds_while_it_serves(stores):
    server, run = stores
    seal = AuditSeal(server, every_s=0.01)

    async def serve() -> list[int]:
        await seal.start()
        run.write(make_record(0))
        deadline = time.monotonic() + 10
        while checkpoints(server.engine) != [1] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        covered = checkpoints(server.engine)
        await seal.aclose()
        return covered

    assert asyncio.run(serve()) == [1]


def test_a_round_that_fails_is_logged_and_the_next_one_signs(stores, monkeypatch, caplog):
    server, run = stores
    seal = AuditSeal(server, every_s=3600)
    run.write(make_record(0))
    cover_head = server.cover_head

    def away() -> int | None:
        raise OSError("database away")

    monkeypatch.setattr(server, "cover_head", away)
    with caplog.at_level(logging.ERROR):
        assert asyncio.run(seal.cover_once()) is None
    assert "the chain head was not signed (OSError: database away); retrying in 3600 s" in caplog.text
    monkeypatch.setattr(server, "cover_head", cover_head)
    assert asyncio.run(seal.cover_once()) == 1
