"""The audit chain (store/audit/store.py): writing, verify catching tampering, checkpoints, retention, concurrency.

Each test runs on SQLite in tmp_path and, marked ``integration``, on PostgreSQL
in a fresh schema (PostgreSQL down fails them; deselect with -m "not integration").
Tampering is done with raw SQL, as someone with database access would.
"""

from __future__ import annotations

import functools
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from store.audit import AuditFilters, AuditStore, VerifyReport
from store.audit.chain import record_hash, uuid7
from store.audit.models import GENESIS_HASH
from store.engine import make_engine
from store.migrate import create_schema

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def make_record(i: int = 0, **overrides: Any) -> dict[str, Any]:
    """A record shaped like the audit stage's, varied by *i*."""
    record = {
        "received_at": T0 + timedelta(minutes=i), "completed_at": T0 + timedelta(minutes=i, seconds=2),
        "first_token_at": T0 + timedelta(minutes=i, milliseconds=300), "duration_ms": 2000.0 + i,
        "ttft_ms": 300.5, "key_id": f"key{i % 3:09d}", "role": "caller", "client_addr": "10.0.0.1",
        "pipeline": "support" if i % 2 == 0 else "rag", "pipeline_version": "3", "spec_sha256": f"{i % 4:064d}",
        "model": "smol" if i % 3 else "big", "weights_hash": "ab" * 32,
        "params": {"temperature": 0.2, "top_p": 1.0, "max_tokens": 256, "seed": i},
        "input_tokens": 10 + i, "output_tokens": 20 + i, "cost_usd": round(0.001 * (i % 5), 6),
        "route": {"decision": "smol", "reason": "default", "fallbacks": []},
        "retrieval": {"index": "handbook", "version": "v1", "doc_ids": ["a", "b"], "scores": [0.9, 0.1 + i]},
        "policy": [{"rule": "pii", "category": "pii", "action": "redact", "score": 0.7}] if i % 4 == 1 else [],
        "status": "denied" if i % 5 == 4 else "ok", "finish_reason": "stop", "http_status": 200,
        "content_mode": "full", "input_content": f"question {i}: how do I reset 100% of it?",
        "output_content": f"answer {i} " + "x" * 100, "request_id": f"req-{i}", "trace_id": f"{i:032x}",
        "stages": [{"stage_id": "guard", "type": "policy", "status": "ok", "duration_ms": 1.25, "cost_usd": 0.0,
                    "decision": {"action": "allow"}},
                   {"stage_id": "gen", "type": "generate", "status": "ok", "duration_ms": 1900.0 + i,
                    "cost_usd": 0.001, "decision": None}],
    }
    record.update(overrides)
    return record


@pytest.fixture
def audit(engine, tmp_path) -> AuditStore:
    return AuditStore(engine, spool_path=tmp_path / "audit.spool", checkpoint_key=b"k" * 32, checkpoint_every=5)


def execute(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


def kinds(report: VerifyReport) -> list[str]:
    return [finding.kind for finding in report.findings]


def raw_record(engine: sa.Engine, seq: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A stored record (typed as the store reads it) and its stages."""
    from store.audit.query import stages_of
    from store.audit.verify import _records

    with engine.connect() as conn:
        row = dict(conn.execute(sa.select(_records).where(_records.c.seq == seq)).mappings().one())
        return row, stages_of(conn, [row["id"]]).get(row["id"], [])


def insert_forged(engine: sa.Engine, row: dict[str, Any]) -> None:
    from store.audit.verify import _records

    with engine.begin() as conn:
        conn.execute(_records.insert(), [row])


# --- writing and a clean chain ------------------------------------------------


def test_a_written_record_comes_back_whole(audit):
    record_id = audit.write(make_record(1))
    found = audit.get(record_id)
    assert (found["seq"], found["prev_hash"], found["kind"]) == (1, GENESIS_HASH, "record")
    assert found["received_at"] == "2026-01-01T12:01:00+00:00"
    assert found["retrieval"]["scores"] == [0.9, 1.1]
    assert (found["policy_action"], found["policy_categories"]) == ("redact", "pii")
    assert [s["stage_id"] for s in found["stages"]] == ["guard", "gen"]
    assert found["stages"][0]["decision"] == {"action": "allow"}
    assert audit.get("no-such-id") is None


def test_ids_are_uuid7_and_a_given_id_is_kept(audit):
    made = uuid.UUID(uuid7())
    assert (made.version, made.variant) == (7, uuid.RFC_4122)
    assert abs(int.from_bytes(made.bytes[:6]) / 1000 - datetime.now(UTC).timestamp()) < 5
    given = str(uuid.uuid4())
    assert audit.write(make_record(id=given)) == given
    assert audit.write(make_record(id=given)) == given  # the same record twice is stored once
    assert audit.verify().checked == 1


def test_the_chain_links_and_verifies(audit):
    for i in range(12):
        audit.write(make_record(i))
    report = audit.verify()
    assert report == VerifyReport(True, 12, 12, [])
    rows = [raw_record(audit.engine, seq)[0] for seq in (1, 2)]
    assert rows[1]["prev_hash"] == rows[0]["hash"]


@pytest.mark.parametrize("bad", [{"nope": 1}, {"status": "weird"}, {"received_at": datetime(2026, 1, 1)},
                                 {"cost_usd": "free"}, {"cost_usd": float("nan")}, {"params": {"x": object()}},
                                 {"content_mode": "plain"}, {"stages": ["x"]}, {"id": 42}, {"model": "m" * 201}])
def test_malformed_records_are_refused_before_the_database(audit, bad):
    with pytest.raises(ValueError):
        audit.write(make_record(**bad))
    assert audit.verify().checked == 0


def test_nul_characters_are_stored_replaced(audit):
    record_id = audit.write(make_record(input_content="a\x00b"))
    assert audit.get(record_id)["input_content"] == "a\ufffdb"
    assert audit.verify().ok


def test_ints_where_floats_belong_still_verify(audit):
    audit.write(make_record(cost_usd=0, duration_ms=5, ttft_ms=None, first_token_at=None, route=None,
                            params={"temperature": 1, "seed": None}, received_at="2026-01-01T12:00:00+02:00"))
    assert audit.verify().ok


def test_awkward_values_come_back_as_hashed(audit):
    # PostgreSQL gets a record as the JSON its hash covers (store/audit/append.py): each value
    # must come back from the database exactly as it was hashed, or verify would call it modified.
    text = "é\n\t\"\\ \u2028 \U0001f600 </script>"
    params = {"big": 1e300, "tiny": 1.5e-07, "neg_zero": -0.0, "huge_int": 2**70, "text": text, "nested": [[{}], []]}
    record_id = audit.write(make_record(1, params=params, duration_ms=1e-05, cost_usd=123456789.123456789,
                                        input_content=text, stages=[{"stage_id": text, "decision": params}]))
    found = audit.get(record_id)
    assert found["params"] == params and found["stages"][0]["decision"] == params
    assert (found["input_content"], found["stages"][0]["stage_id"]) == (text, text)
    assert audit.verify().ok


# --- tampering ----------------------------------------------------------------


@pytest.fixture(params=[1, 3], ids=["one-process", "3-workers"])
def chain(audit, request, monkeypatch) -> AuditStore:
    """Ten records; verify runs in this process, or split over 3 worker processes (seqs 1-4, 5-8, 9-10:
    a reordered pair 4/5 sits across a range boundary)."""
    for i in range(10):
        audit.write(make_record(i))
    monkeypatch.setattr(audit, "verify", functools.partial(audit.verify, workers=request.param))
    return audit


def test_an_edited_field_is_modified(chain):
    execute(chain.engine, "UPDATE audit_records SET cost_usd = 99 WHERE seq = 4")
    report = chain.verify()
    assert not report.ok
    assert [(f.kind, f.seq) for f in report.findings] == [("modified", 4)]


def test_an_edited_stage_is_modified(chain):
    execute(chain.engine, "UPDATE audit_stages SET duration_ms = 1 WHERE record_id = "
                          "(SELECT id FROM audit_records WHERE seq = 6) AND position = 1")
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("modified", 6)]


def test_a_deleted_row_is_deleted(chain):
    execute(chain.engine, "DELETE FROM audit_stages WHERE record_id = (SELECT id FROM audit_records WHERE seq = 5)")
    execute(chain.engine, "DELETE FROM audit_records WHERE seq = 5")
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("deleted", 5)]


def test_a_deleted_tail_is_deleted(chain):
    execute(chain.engine, "DELETE FROM audit_stages WHERE record_id = (SELECT id FROM audit_records WHERE seq = 10)")
    execute(chain.engine, "DELETE FROM audit_records WHERE seq = 10")
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("deleted", 10)]


@pytest.mark.parametrize("first", [3, 4])  # with 3 workers, 4 and 5 are checked by different processes
def test_a_reordered_pair_is_reordered(chain, first):
    execute(chain.engine, "UPDATE audit_records SET seq = -1 WHERE seq = :s", s=first)
    execute(chain.engine, "UPDATE audit_records SET seq = :s WHERE seq = :n", s=first, n=first + 1)
    execute(chain.engine, "UPDATE audit_records SET seq = :n WHERE seq = -1", n=first + 1)
    report = chain.verify()
    assert [(f.kind, f.seq) for f in report.findings] == [("reordered", first)]
    assert report.checked == 10


def test_a_row_inserted_mid_chain_is_inserted(chain):
    prev, _ = raw_record(chain.engine, 5)
    for seq in range(10, 5, -1):  # make room at seq 6, as a forger would
        execute(chain.engine, "UPDATE audit_records SET seq = :new WHERE seq = :old", new=seq + 1, old=seq)
    forged = {**prev, "id": uuid7(), "seq": 6, "prev_hash": prev["hash"], "cost_usd": 0.5}
    forged["hash"] = record_hash(forged["prev_hash"], forged, [])
    insert_forged(chain.engine, forged)
    report = chain.verify()
    assert ("inserted", 6) in [(f.kind, f.seq) for f in report.findings]
    assert not report.ok


def test_a_row_appended_behind_the_stores_back_is_inserted(chain):
    last, _ = raw_record(chain.engine, 10)
    forged = {**last, "id": uuid7(), "seq": 11, "prev_hash": last["hash"]}
    forged["hash"] = record_hash(forged["prev_hash"], forged, [])
    insert_forged(chain.engine, forged)
    assert ("inserted", 11) in [(f.kind, f.seq) for f in chain.verify().findings]


def test_a_rehashed_edit_breaks_the_link(chain):
    row, stages = raw_record(chain.engine, 4)
    new_hash = record_hash(row["prev_hash"], {**row, "status": "ok", "cost_usd": 0.0}, stages)
    execute(chain.engine, "UPDATE audit_records SET cost_usd = 0, status = 'ok', hash = :h WHERE seq = 4", h=new_hash)
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("gap", 5)]


def test_legal_hold_is_outside_the_hash(chain):
    assert chain.set_hold(pipeline="support") == 5
    assert chain.verify().ok


# --- checkpoints --------------------------------------------------------------


def test_checkpoints_every_n_and_on_demand(chain):
    with chain.engine.connect() as conn:
        assert list(conn.scalars(sa.text("SELECT seq FROM audit_checkpoints ORDER BY seq"))) == [5, 10]
    chain.write(make_record(11))
    assert chain.checkpoint()["seq"] == 11
    assert chain.verify(checkpoint_key=b"k" * 32).ok


def test_a_wrong_key_or_forged_checkpoint_fails(chain):
    assert kinds(chain.verify(checkpoint_key=b"other")) == ["bad_checkpoint", "bad_checkpoint"]
    execute(chain.engine, "UPDATE audit_checkpoints SET head_hash = :h WHERE seq = 5", h="0" * 64)
    assert kinds(chain.verify()) == ["bad_checkpoint"]


def test_a_rewritten_tail_is_caught_by_the_checkpoint(chain):
    # A forger who rewrites the last record and the chain head, consistently, without the key.
    row, stages = raw_record(chain.engine, 10)
    edited = {**row, "cost_usd": 0.0}
    edited["hash"] = record_hash(row["prev_hash"], edited, stages)
    execute(chain.engine, "UPDATE audit_records SET cost_usd = 0, hash = :h WHERE seq = 10", h=edited["hash"])
    execute(chain.engine, "UPDATE audit_chain_head SET hash = :h", h=edited["hash"])
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("bad_checkpoint", 10)]


# --- retention ----------------------------------------------------------------


def test_prune_respects_retention_and_hold_and_verify_passes(chain):
    now = T0 + timedelta(days=30, minutes=5)  # records 0..4 are older than 30 days, 5..9 newer
    [record_two] = [r for r in chain.query(AuditFilters()).records if r["request_id"] == "req-2"]
    assert chain.set_hold(record_ids=[record_two["id"]]) == 1
    report = chain.prune({"support": 30}, now=now)  # rag is not listed: kept forever
    assert report.deleted == 2  # req-0 and req-4; req-2 is held
    left = sorted(r["request_id"] for r in chain.query(AuditFilters(), limit=100).records)
    assert left == sorted(f"req-{i}" for i in range(10) if i not in (0, 4))
    marker = chain.get(report.marker_id)
    assert marker["kind"] == "prune" and marker["pruned"]["deleted"] == 2
    assert chain.verify().ok
    assert chain.prune({"support": 30}, now=now).deleted == 0


def test_prune_over_prune_and_an_unexplained_deletion_after(chain):
    chain.prune({"support": 0, "rag": 0}, now=T0 + timedelta(minutes=3))  # seqs 1..3
    chain.prune({"support": 0, "rag": 0}, now=T0 + timedelta(minutes=6))  # seqs 4..6, adjacent
    chain.write(make_record(20))
    assert chain.verify().ok
    execute(chain.engine, "DELETE FROM audit_stages WHERE record_id = (SELECT id FROM audit_records WHERE seq = 8)")
    execute(chain.engine, "DELETE FROM audit_records WHERE seq = 8")
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("deleted", 8)]


def test_a_row_put_back_into_a_pruned_range_is_inserted(chain):
    row, _ = raw_record(chain.engine, 2)
    chain.prune({"support": 0, "rag": 0}, now=T0 + timedelta(minutes=3))
    insert_forged(chain.engine, row)
    assert kinds(chain.verify()) == ["inserted"]


def test_prune_refuses_bad_retention(chain):
    with pytest.raises(ValueError):
        chain.prune({"support": -1})
    with pytest.raises(ValueError):
        chain.set_hold()


# --- concurrency --------------------------------------------------------------


def test_eight_threads_make_one_contiguous_chain(audit):
    def work(t: int) -> None:
        for i in range(50):
            audit.write(make_record(t * 50 + i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with audit.engine.connect() as conn:
        assert list(conn.scalars(sa.text("SELECT seq FROM audit_records ORDER BY seq"))) == list(range(1, 401))
    assert audit.verify() == VerifyReport(True, 400, 400, [])


def test_separate_stores_share_the_chain_through_the_head_lock(engine, tmp_path):
    # Separate engines and stores: no shared Python lock, as with separate processes.
    url = engine.url.render_as_string(hide_password=False)
    engines = [make_engine(url) for _ in range(3)]
    stores = [AuditStore(e, spool_path=tmp_path / f"s{n}.spool") for n, e in enumerate(engines)]
    threads = [threading.Thread(target=lambda s=s: [s.write(make_record(i)) for i in range(30)]) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for e in engines:
        e.dispose()
    assert all(store.writer._spool.is_empty() for store in stores)
    assert AuditStore(engine, spool_path=tmp_path / "v.spool").verify() == VerifyReport(True, 90, 90, [])


def test_verify_a_time_window(chain):
    window = chain.verify(since=T0 + timedelta(minutes=3), until=T0 + timedelta(minutes=7))
    assert (window.ok, window.checked) == (True, 4)
    execute(chain.engine, "UPDATE audit_records SET cost_usd = 99 WHERE seq = 9")  # outside the window
    assert chain.verify(since=T0 + timedelta(minutes=3), until=T0 + timedelta(minutes=7)).ok
    assert [(f.kind, f.seq) for f in chain.verify(since=T0 + timedelta(minutes=7)).findings] == [("modified", 9)]


# --- verify in parallel ---------------------------------------------------------


@pytest.fixture
def worker_answers(monkeypatch) -> list[bytes | None]:
    """Each worker process's answer (None: it failed), in the order they were asked."""
    import store.audit.verify as verify

    answers: list[bytes | None] = []
    real = verify._run_worker

    def spy(*args: Any) -> bytes | None:
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(verify, "_run_worker", spy)
    return answers


def test_long_spans_are_hashed_by_worker_processes(engine, tmp_path, monkeypatch, worker_answers):
    import store.audit.verify as verify

    store = AuditStore(engine, spool_path=tmp_path / "audit.spool")
    store.write_many([make_record(i) for i in range(60)])
    monkeypatch.setattr(verify, "MIN_ROWS_PER_WORKER", 10)
    monkeypatch.setattr(verify, "MAX_ROWS_PER_RANGE", 25)  # 60 records: 3 ranges of 20
    assert store.verify() == VerifyReport(True, 60, 60, [])
    assert len(worker_answers) == 3 and None not in worker_answers
    execute(engine, "UPDATE audit_records SET cost_usd = 99 WHERE seq = 41")  # the last range's first row
    assert [(f.kind, f.seq) for f in store.verify().findings] == [("modified", 41)]


@pytest.mark.parametrize("executable", ["/nonexistent/python", "/bin/false"])
def test_a_worker_that_fails_leaves_its_range_to_this_process(engine, tmp_path, monkeypatch, caplog,
                                                             worker_answers, executable):
    import store.audit.verify as verify

    store = AuditStore(engine, spool_path=tmp_path / "audit.spool")
    store.write_many([make_record(i) for i in range(30)])
    execute(engine, "UPDATE audit_records SET cost_usd = 99 WHERE seq = 20")
    monkeypatch.setattr(verify.sys, "executable", executable)
    report = store.verify(workers=2)
    assert [(f.kind, f.seq) for f in report.findings] == [("modified", 20)] and report.checked == 30
    assert worker_answers == [None, None]
    assert "checking seq 1..15 here" in caplog.text and "checking seq 16..30 here" in caplog.text


def test_an_in_memory_database_is_verified_in_this_process(tmp_path, worker_answers):
    engine = make_engine("sqlite://")
    create_schema(engine)
    store = AuditStore(engine, spool_path=tmp_path / "audit.spool")
    store.write_many([make_record(i) for i in range(5)])
    assert store.verify(workers=4) == VerifyReport(True, 5, 5, [])
    assert worker_answers == []  # another process could not see this database


def test_workers_below_one_are_refused(chain):
    with pytest.raises(ValueError, match="at least 1"):
        AuditStore.verify(chain, workers=0)


def test_a_failed_workers_error_is_logged_without_the_database_password(tmp_path, monkeypatch, caplog):
    import store.audit.verify as verify

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat >&2\nexit 3\n")  # fails, quoting its stdin (which holds the URL)
    fake.chmod(0o755)
    monkeypatch.setattr(verify.sys, "executable", str(fake))
    assert verify._run_worker("postgresql+psycopg://auditor:s3cret-pw@127.0.0.1/audit", 1, 2) is None
    assert "a worker failed" in caplog.text and "checking seq 1..2 here" in caplog.text
    assert "s3cret-pw" not in caplog.text and "***" in caplog.text
