"""Ed25519 checkpoints and digests outside the database (store/audit/signing.py, store/audit/anchors.py).

Each tampering is done with raw SQL or on the files, as an insider would, on SQLite and (marked
integration) on PostgreSQL; each is detected once the digests are checked too, and the tests say which
ones the database alone cannot show.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from store.audit import AuditStore
from store.audit.anchors import Anchors, digest_name, verify_anchors
from store.audit.chain import record_hash
from store.audit.models import AuditChainHead, AuditCheckpoint, AuditRecord, AuditStage
from store.audit.signing import Ed25519Signer, Verifier, generate_pem
from tests.store.audit.test_store import execute, make_record, raw_record

PRIVATE, PUBLIC = generate_pem()
SIGNER = Ed25519Signer.from_pem(PRIVATE)
LATER = datetime.now(UTC) + timedelta(hours=1)


@pytest.fixture
def logged(engine, tmp_path) -> tuple[AuditStore, Anchors]:
    """Twenty records, a checkpoint every five, each delivered as a digest."""
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=5)
    for i in range(20):
        store.write(make_record(i))
    anchors = Anchors(engine, tmp_path / "digests", SIGNER)
    assert [d["seq"] for d in anchors.deliver().written] == [5, 10, 15, 20]
    return store, anchors


def public_only() -> Verifier:
    return Verifier(public_keys=[PUBLIC])


def check(store: AuditStore, anchors: Anchors, now: datetime | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """(what the database alone finds, what the digests find), both with the public key alone."""
    alone = store.verify(checkpoint_key=public_only())
    anchored = verify_anchors(store.engine, anchors.folder, public_only(), now=now)
    return [f.kind for f in alone.findings], [(f.kind, f.seq) for f in anchored.findings]


def test_a_clean_log_verifies_with_the_public_key_alone(logged):
    store, anchors = logged
    report = store.verify(checkpoint_key=public_only())
    assert report.ok and report.unchecked_checkpoints == 0
    anchored = verify_anchors(store.engine, anchors.folder, public_only())
    assert anchored.ok and anchored.digests == 4 and anchored.anchored_seq == 20 and anchored.unchecked == 0
    assert anchors.deliver().written == []  # nothing new: nothing written twice
    digest = json.loads((anchors.folder / digest_name(10)).read_text())
    assert digest["first_seq"] == 6 and digest["key_id"] == SIGNER.key_id and digest["algorithm"] == "ed25519"
    other = Verifier(public_keys=[generate_pem()[1]])  # another key: nothing it can check
    assert store.verify(checkpoint_key=other).unchecked_checkpoints == 4


def test_a_forged_checkpoint_fails_the_public_key(logged):
    store, _ = logged
    execute(store.engine, "UPDATE audit_checkpoints SET head_hash = :h WHERE seq = 10", h="0" * 64)
    assert [(f.kind, f.seq) for f in store.verify(checkpoint_key=public_only()).findings] == [("bad_checkpoint", 10)]


def test_hmac_checkpoints_and_a_rotated_key_keep_verifying(engine, tmp_path):
    old_private, old_public = generate_pem()
    for key in (b"k" * 32, Ed25519Signer.from_pem(old_private), SIGNER):  # HMAC, then two Ed25519 keys
        store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=key, checkpoint_every=5)
        for i in range(5):
            store.write(make_record(i))
    with engine.connect() as conn:
        assert list(conn.execute(sa.select(AuditCheckpoint.algorithm).order_by(AuditCheckpoint.seq)).scalars()) == [
            "hmac-sha256", "ed25519", "ed25519"]
    every = Verifier(public_keys=[old_public, PUBLIC], hmac_key=b"k" * 32)
    assert store.verify(checkpoint_key=every).ok and store.verify(checkpoint_key=every).unchecked_checkpoints == 0
    newest_only = store.verify(checkpoint_key=public_only())
    assert newest_only.ok and newest_only.unchecked_checkpoints == 2  # HMAC needs the secret; the old key its .pub
    # The server's own reader checks with its signer's public key and the configured older ones.
    server = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, public_keys=[old_public])
    assert server.verify().ok and server.verify().unchecked_checkpoints == 1


# --- tampering that the chain alone shows (the digests agree) -------------------------


def test_an_edited_field_a_deleted_and_a_reordered_record(logged):
    store, anchors = logged
    execute(store.engine, "UPDATE audit_records SET cost_usd = 99 WHERE seq = 3")
    execute(store.engine, "DELETE FROM audit_stages WHERE record_id = (SELECT id FROM audit_records WHERE seq = 8)")
    execute(store.engine, "DELETE FROM audit_records WHERE seq = 8")
    execute(store.engine, "UPDATE audit_records SET seq = -1 WHERE seq = 12")
    execute(store.engine, "UPDATE audit_records SET seq = 12 WHERE seq = 13")
    execute(store.engine, "UPDATE audit_records SET seq = 13 WHERE seq = -1")
    alone, anchored = check(store, anchors)
    assert alone == ["modified", "deleted", "reordered"] and anchored == []


def test_an_inserted_record(logged):
    store, anchors = logged
    last, _ = raw_record(store.engine, 20)
    forged = {**last, "id": "forged", "seq": 21, "prev_hash": last["hash"]}
    forged["hash"] = record_hash(forged["prev_hash"], forged, [])
    with store.engine.begin() as conn:
        conn.execute(sa.insert(AuditRecord).values(**forged))
    alone, _ = check(store, anchors)
    assert "inserted" in alone


# --- tampering only the digests show ---------------------------------------------------


def cut_tail(engine: sa.Engine, keep: int) -> None:
    """Remove the records after seq *keep* with their checkpoints, and move the chain head back."""
    head, _ = raw_record(engine, keep)
    execute(engine, "DELETE FROM audit_stages WHERE record_id IN (SELECT id FROM audit_records WHERE seq > :k)", k=keep)
    execute(engine, "DELETE FROM audit_records WHERE seq > :k", k=keep)
    execute(engine, "DELETE FROM audit_checkpoints WHERE seq > :k", k=keep)
    execute(engine, "UPDATE audit_chain_head SET seq = :s, hash = :h", s=keep, h=head["hash"])


def test_the_tail_cut_with_its_checkpoints(logged):
    store, anchors = logged
    cut_tail(store.engine, 12)
    alone, anchored = check(store, anchors)
    assert alone == [] and anchored == [("tail_cut", 13)]  # the database alone cannot show it
    assert anchors.deliver().mismatch is not None  # the delivery's alarm, too


def snapshot(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    with engine.connect() as conn:
        return {table.name: [dict(row._mapping) for row in conn.execute(sa.select(table))]
                for table in (AuditRecord.__table__, AuditStage.__table__, AuditCheckpoint.__table__,
                              AuditChainHead.__table__)}


def restore(engine: sa.Engine, copy: dict[str, list[dict[str, Any]]]) -> None:
    """Replace the log with an older copy of itself, as a restore from a backup would."""
    tables = (AuditStage.__table__, AuditCheckpoint.__table__, AuditChainHead.__table__, AuditRecord.__table__)
    with engine.begin() as conn:
        for table in tables:
            conn.execute(sa.delete(table))
        for table in reversed(tables):
            if copy[table.name]:
                conn.execute(sa.insert(table), copy[table.name])


def test_an_older_copy_restored_and_then_written_on(engine, tmp_path):
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=5)
    anchors = Anchors(engine, tmp_path / "digests", SIGNER)
    for i in range(10):
        store.write(make_record(i))
    older = snapshot(engine)
    for i in range(10, 20):
        store.write(make_record(i))
    anchors.deliver()
    restore(engine, older)
    alone, anchored = check(store, anchors)
    assert alone == [] and anchored == [("tail_cut", 11)]
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=5)
    now = datetime.now(UTC) + timedelta(seconds=1)
    for i in range(10, 20):  # the restored database serves on: seqs 11-20 again, other records
        store.write(make_record(i, received_at=now, completed_at=now, first_token_at=None))
    alone, anchored = check(store, anchors)
    assert alone == [] and anchored == [("rolled_back", 11), ("rolled_back", 16)]


def test_a_range_rewritten_and_rechained_with_its_checkpoints_removed(logged):
    store, anchors = logged
    prev_hash = raw_record(store.engine, 6)[0]["hash"]
    for seq in range(7, 21):  # seq 7 edited, every hash after it recomputed: the chain agrees with itself
        row, stages = raw_record(store.engine, seq)
        edited = {**row, "prev_hash": prev_hash, "cost_usd": 0.0 if seq == 7 else row["cost_usd"]}
        edited["hash"] = prev_hash = record_hash(prev_hash, edited, stages)
        execute(store.engine, "UPDATE audit_records SET cost_usd = :c, prev_hash = :p, hash = :h WHERE seq = :s",
                c=edited["cost_usd"], p=edited["prev_hash"], h=edited["hash"], s=seq)
    execute(store.engine, "DELETE FROM audit_checkpoints WHERE seq > 5")
    execute(store.engine, "UPDATE audit_chain_head SET hash = :h", h=prev_hash)
    alone, anchored = check(store, anchors)
    assert alone == []
    assert anchored == [("rewritten", 6), ("rewritten", 11), ("rewritten", 16)]


# --- the digests themselves ----------------------------------------------------------------


def test_a_digest_removed_or_replaced(logged):
    store, anchors = logged
    (anchors.folder / digest_name(10)).unlink()
    assert check(store, anchors)[1] == [("digest_missing", 6), ("digest_missing", 10)]
    edited = json.loads((anchors.folder / digest_name(15)).read_text())
    edited["head_hash"] = "0" * 64
    (anchors.folder / digest_name(15)).write_text(json.dumps(edited))
    assert ("digest_altered", 15) in check(store, anchors)[1]


def test_the_newest_digest_removed(logged):
    store, anchors = logged
    (anchors.folder / digest_name(20)).unlink()
    assert check(store, anchors)[1] == []  # just made: its delivery may still be under way
    assert check(store, anchors, now=LATER)[1] == [("digest_missing", 20)]


def test_delivery_never_overwrites_and_resumes_after_the_newest(logged, engine):
    store, anchors = logged
    before = {path.name: path.read_bytes() for path in anchors.folder.iterdir()}
    for i in range(20, 25):
        store.write(make_record(i))
    written = anchors.deliver().written
    assert [d["seq"] for d in written] == [25] and written[0]["first_seq"] == 21
    assert all((anchors.folder / name).read_bytes() == data for name, data in before.items())
    assert verify_anchors(engine, anchors.folder, public_only()).ok


def test_verify_needs_the_folder(logged, tmp_path):
    store, _ = logged
    with pytest.raises(FileNotFoundError):
        verify_anchors(store.engine, Path(tmp_path / "nope"), public_only())
