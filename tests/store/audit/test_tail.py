"""The newest records: a checkpoint at the chain head whoever appended them (``AuditWriter.cover_head``),
verify naming the records no checkpoint covers, and a cut of them shown by the digests once covered.

On SQLite and (marked integration) on PostgreSQL, where writers in several processes share one chain.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from store.audit import AuditStore
from store.audit.anchors import Anchors, verify_anchors
from store.audit.models import AuditCheckpoint
from store.audit.signing import Ed25519Signer, generate_pem
from store.audit.verify import Tail, verify_chain
from store.engine import make_engine
from tests.store.audit.test_anchors import SIGNER, cut_tail, public_only
from tests.store.audit.test_store import T0, execute, make_record

WINDOW_S = 4.0


def checkpoints(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.scalars(sa.select(AuditCheckpoint.seq).order_by(AuditCheckpoint.seq)))


def test_records_a_keyless_writer_appended_are_covered_by_the_next_checkpoint_at_the_head(engine, tmp_path):
    keyless = AuditStore(engine, spool_path=tmp_path / "run.spool")  # inferline run, eval, audit erase
    server = AuditStore(engine, spool_path=tmp_path / "server.spool", checkpoint_key=SIGNER, checkpoint_every=5)
    for i in range(7):
        keyless.write(make_record(i))
    assert checkpoints(engine) == []  # seq 5 passed by without its checkpoint: only the bare chain
    assert server.cover_head() == 7
    assert server.cover_head() is None  # nothing new: nothing signed, nothing written
    server.write(make_record(7))
    assert server.cover_head() == 8
    assert checkpoints(engine) == [7, 8]
    report = verify_chain(engine, None, None, public_only(), window_s=WINDOW_S)
    assert report.ok and report.uncovered is None


def test_verify_names_the_uncovered_records_and_a_missing_checkpoint_past_the_window(engine, tmp_path):
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=5)
    for i in range(7):
        store.write(make_record(i))  # a checkpoint at seq 5; seqs 6 and 7 after it
    oldest = T0 + timedelta(minutes=5, seconds=2)  # seq 6's completed_at
    within = verify_chain(engine, None, None, public_only(), window_s=WINDOW_S, now=oldest + timedelta(seconds=3))
    assert within.ok and within.uncovered == Tail(6, 7, 2, oldest)
    late = verify_chain(engine, None, None, public_only(), window_s=WINDOW_S, now=oldest + timedelta(minutes=12))
    assert [(f.kind, f.seq) for f in late.findings] == [("missing_checkpoint", 6)]
    assert "seq 6..7: 2 record(s), the oldest written 12 min ago, are covered by no signed checkpoint" in \
        late.findings[0].detail
    # A checkpoint the keys given cannot vouch for covers nothing: another key's, or a forged one.
    other = Ed25519Signer.from_pem(generate_pem()[0])
    AuditStore(engine, spool_path=tmp_path / "other.spool", checkpoint_key=other).cover_head()
    assert verify_chain(engine, None, None, public_only(), window_s=WINDOW_S, now=oldest).uncovered == Tail(6, 7, 2,
                                                                                                          oldest)
    execute(engine, "UPDATE audit_checkpoints SET head_hash = :h WHERE seq = 5", h="0" * 64)
    forged = verify_chain(engine, None, None, public_only(), window_s=WINDOW_S, now=T0)
    assert forged.uncovered == Tail(1, 7, 7, T0 + timedelta(seconds=2))
    # Without a window, or without keys, verify says nothing of them.
    assert verify_chain(engine, None, None, public_only()).uncovered is None
    assert verify_chain(engine, None, None, None, window_s=WINDOW_S).uncovered is None


def test_a_cut_of_the_newest_records_shows_against_the_digests_once_the_head_is_signed(engine, tmp_path):
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER)  # checkpoint_every: 1000
    anchors = Anchors(engine, tmp_path / "digests", SIGNER)
    for i in range(3):
        store.write(make_record(i))
    store.cover_head()  # what the server's seal does every checkpoint_every_s...
    assert [d["seq"] for d in anchors.deliver().written] == [3]  # ...and its delivery every anchors.every_s
    for i in range(3, 8):
        store.write(make_record(i))
    store.cover_head()  # the window passes: the next round of each
    assert [d["seq"] for d in anchors.deliver().written] == [8]
    cut_tail(engine, 3)  # the five newest with their checkpoint, the head moved back
    assert store.verify(checkpoint_key=public_only()).ok  # the database agrees with itself...
    anchored = verify_anchors(engine, anchors.folder, public_only())
    assert [(f.kind, f.seq) for f in anchored.findings] == [("tail_cut", 4)]  # ...not with the digests


def test_a_checkpoint_undelivered_past_the_window_is_a_missing_digest(engine, tmp_path):
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=5)
    anchors = Anchors(engine, tmp_path / "digests", SIGNER)
    for i in range(5):
        store.write(make_record(i))
    anchors.deliver()
    for i in range(5, 12):
        store.write(make_record(i))  # a checkpoint at seq 10, not delivered yet
    made = datetime.now(UTC)
    within = verify_anchors(engine, anchors.folder, public_only(), now=made + timedelta(seconds=1), window_s=WINDOW_S)
    assert within.ok and within.unanchored == Tail(6, 12, 7, T0 + timedelta(minutes=5, seconds=2))
    late = verify_anchors(engine, anchors.folder, public_only(), now=made + timedelta(seconds=30), window_s=WINDOW_S)
    assert [(f.kind, f.seq) for f in late.findings] == [("digest_missing", 10)]
    assert verify_anchors(engine, anchors.folder, public_only(), now=made + timedelta(seconds=30)).ok  # 10 min


def test_two_deliverers_on_one_folder_keep_one_chain_of_digests(engine, tmp_path):
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=2)
    mine, theirs = Anchors(engine, tmp_path / "digests", SIGNER), Anchors(engine, tmp_path / "digests", SIGNER)
    for n in range(6):
        store.write(make_record(2 * n))
        store.write(make_record(2 * n + 1))
        (mine if n % 3 else theirs).deliver()  # each remembers its newest digest; the other's are taken as found
    mine.deliver()
    theirs.deliver()
    report = verify_anchors(engine, mine.folder, public_only())
    assert report.ok and report.digests == 6 and report.anchored_seq == 12


def cover_together(store: AuditStore, barrier: threading.Barrier, signed: list[int | None]) -> None:
    barrier.wait()
    signed.append(store.cover_head())


def test_writers_sharing_a_database_sign_each_head_once(engine, tmp_path):
    other_engine = make_engine(engine.url.render_as_string(hide_password=False))  # another process's
    try:
        stores = [AuditStore(e, spool_path=tmp_path / f"{n}.spool", checkpoint_key=SIGNER)
                  for n, e in enumerate((engine, other_engine))]
        for round_ in range(5):
            for i in range(3):
                stores[i % 2].write(make_record(round_ * 3 + i))
            barrier, signed = threading.Barrier(2), []
            threads = [threading.Thread(target=cover_together, args=(store, barrier, signed)) for store in stores]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(signed, key=str) == [3 * (round_ + 1), None]  # one of them signed this head
        assert checkpoints(engine) == [3, 6, 9, 12, 15]
        assert verify_chain(engine, None, None, public_only(), window_s=WINDOW_S).ok
    finally:
        other_engine.dispose()
