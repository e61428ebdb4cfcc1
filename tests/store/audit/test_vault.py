"""content: encrypted and erasure by crypto-shredding (store/audit/vault.py), on SQLite and PostgreSQL:
the content is unreadable afterwards, the chain still verifies, the erasure is a chained record of its
own, and a record on legal hold refuses."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import sqlalchemy as sa

from store.audit import AuditReader, AuditStore
from store.audit.filters import AuditFilters
from store.audit.vault import PREFIX, ContentVault, VaultError, legacy_subject_id, parse_master_key
from tests.store.audit.test_store import execute, make_record

MASTER = os.urandom(32)


@pytest.fixture
def vault(engine) -> ContentVault:
    return ContentVault(engine, MASTER)


@pytest.fixture
def store(engine, tmp_path, vault) -> AuditStore:
    return AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=b"k" * 32, checkpoint_every=4,
                      vault=vault)


def encrypted(vault: ContentVault, i: int, subject: str) -> dict:
    """A record as the server's sink writes it with content encrypted: its content and tags sealed, its
    subject named by the keyed hash only."""
    record = make_record(i, content_mode="encrypted")
    record["input_content"] = vault.encrypt(subject, f"alice's question {i}")
    record["output_content"] = vault.encrypt(subject, f"answer {i}")
    record["tags"] = vault.encrypt(subject, json.dumps({"user": subject.rsplit(":", 1)[-1]}))
    record["subject_hash"] = vault.subject_hash(subject)
    return record


def test_encrypted_content_reads_back_until_erased_and_the_chain_verifies_throughout(store, vault):
    for i in range(6):
        store.write(encrypted(vault, i, "tags.user:alice" if i % 2 == 0 else "tags.user:bob"))
    records = store.query(store_filters(), sort="received_at").records
    assert all(r["input_content"].startswith(PREFIX) and "alice" not in r["input_content"] for r in records)
    first = store.reader.reveal(store.get(records[0]["id"]), "k1", "auditor")
    assert first["decrypted"] == {"input": "alice's question 0", "output": "answer 0", "tags": {"user": "alice"},
                                  "tools": []}
    assert not first["content_erased"]
    assert store.verify().ok
    report = store.erase("tags.user:alice", by="dpo")
    assert report.records == 3 and report.keys_destroyed == 1
    assert store.reader.reveal(store.get(records[0]["id"]), "k1", "auditor")["content_erased"] is True
    assert store.reader.reveal(store.get(records[1]["id"]), "k1", "auditor")["decrypted"]["output"] == "answer 1"
    assert store.verify().ok  # the ciphertext is what was hashed: nothing changed in the chain
    erasure = store.get(report.record_id)
    assert erasure["policy"][0]["where"] == "erase" and "3 record(s)" in erasure["policy"][0]["message"]
    assert erasure["key_id"] == "dpo" and "alice" not in str(erasure)  # the subject only as its hash
    actions = [entry["action"] for entry in store.access_log(10)]
    assert actions.count("decrypt") == 3
    # alice asks again: a new key, readable, and erasable in turn
    store.write(encrypted(vault, 6, "tags.user:alice"))
    newest = next(r for r in store.query(store_filters()).records if r["request_id"] == "req-6")
    assert store.reader.reveal(newest, None, "cli")["decrypted"]["input"] == "alice's question 6"
    assert store.erase("tags.user:alice", by="dpo").records == 4  # the erased three and the new one
    with pytest.raises(ValueError, match="no encrypted audit content"):
        store.erase("tags.user:carol", by="dpo")


def test_a_subject_is_named_by_a_keyed_hash_which_finds_its_records(engine, store, vault):
    for i in range(4):
        store.write(encrypted(vault, i, "tags.user:alice" if i < 3 else "tags.user:bob"))
    keyed = vault.subject_hash("tags.user:alice")
    # Keyed: another master key gives another hash, and it is not the plain hash anyone can compute.
    assert keyed not in (ContentVault(engine, os.urandom(32)).subject_hash("tags.user:alice"),
                         legacy_subject_id("tags.user:alice"), hashlib.sha256(b"tags.user:alice").hexdigest())
    with engine.connect() as conn:
        assert set(conn.scalars(sa.text("SELECT subject_id FROM audit_data_keys"))) == \
            {keyed, vault.subject_hash("tags.user:bob")}
    found = store.query(AuditFilters(subject="tags.user:alice"), sort="received_at").records
    assert [r["request_id"] for r in found] == ["req-0", "req-1", "req-2"]
    assert found[0]["subject_hash"] == keyed and found[0]["tags"].startswith(PREFIX)
    assert [g["count"] for g in store.summary(AuditFilters(subject="tags.user:bob"), "pipeline")] == [1]
    assert len(list(store.export(AuditFilters(subject="tags.user:alice"), "jsonl"))) == 3
    # The access log keeps the subject asked for as its keyed hash.
    store.log_access("k1", "auditor", "query", {"subject": "tags.user:alice", "limit": 5})
    assert store.access_log(1)[0]["query"] == {"subject_hash": keyed, "limit": 5}
    with pytest.raises(ValueError, match="master_key"):
        AuditReader(engine).query(AuditFilters(subject="tags.user:alice"))


def test_records_and_keys_from_before_keyed_hashes_are_found_erased_and_renamed(engine, store, vault):
    for i in range(2):  # as written before: no subject_hash in the records, the key under the plain hash
        store.write({**encrypted(vault, i, "tenant:acme"), "subject_hash": None})
    legacy = legacy_subject_id("tenant:acme")
    execute(engine, "UPDATE audit_data_keys SET subject_id = :legacy", legacy=legacy)
    assert len(store.query(AuditFilters(subject="tenant:acme")).records) == 2  # by their data key
    ContentVault(engine, MASTER).encrypt("tenant:acme", "again")  # a process naming the subject renames its key
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT subject_id FROM audit_data_keys")).scalars().all() == \
            [vault.subject_hash("tenant:acme")]
    execute(engine, "UPDATE audit_data_keys SET subject_id = :legacy", legacy=legacy)
    report = store.erase("tenant:acme", by="dpo")
    assert (report.records, report.keys_destroyed, report.subject_id) == (2, 1, vault.subject_hash("tenant:acme"))
    with engine.connect() as conn:  # no plain hash of an erased subject is left
        assert conn.scalar(sa.text("SELECT count(*) FROM audit_data_keys WHERE subject_id = :s"), {"s": legacy}) == 0
    assert store.verify().ok


def test_a_subject_on_legal_hold_refuses_erasure(store, vault):
    for i in range(3):
        store.write(encrypted(vault, i, "tenant:acme"))
    held = store.query(store_filters(), sort="received_at").records[1]["id"]
    assert store.set_hold(record_ids=[held]) == 1
    with pytest.raises(ValueError, match=r"1 of this subject's 3 record.* legal hold"):
        store.erase("tenant:acme", by="dpo")
    assert store.reader.reveal(store.get(held), None, "cli")["decrypted"] is not None  # nothing was erased
    store.set_hold(record_ids=[held], on=False)
    assert store.erase("tenant:acme", by="dpo").records == 3


def test_a_wrong_master_key_or_an_altered_ciphertext_is_refused(engine, store, vault):
    store.write(encrypted(vault, 0, "tenant:acme"))
    with pytest.raises(VaultError, match="does not unwrap"):
        ContentVault(engine, os.urandom(32)).check()
    ContentVault(engine, MASTER).check()
    record = store.query(store_filters()).records[0]
    tampered = record["input_content"][:-6] + ("AAAA==" if not record["input_content"].endswith("AAAA==") else "BBBB==")
    with pytest.raises(VaultError, match="altered"):
        vault.decrypt(tampered)


def test_the_master_key_is_32_bytes():
    assert parse_master_key(MASTER.hex()) == MASTER
    with pytest.raises(ValueError, match="32 bytes"):
        parse_master_key("short")


def test_without_a_vault_there_is_nothing_to_erase(engine, tmp_path):
    with pytest.raises(ValueError, match="master_key"):
        AuditStore(engine, spool_path=tmp_path / "spool").erase("tenant:acme", by="dpo")


def test_the_database_takes_encrypted_content_only_as_a_known_mode(engine, store, vault):
    store.write(encrypted(vault, 0, "tenant:acme"))
    with pytest.raises(sa.exc.IntegrityError):
        execute(engine, "UPDATE audit_records SET content_mode = 'plain'")


def store_filters():
    return AuditFilters()
