"""Reading the audit log: each filter, keyset pagination, exports, summaries, hostile input."""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta

import pytest
import sqlalchemy as sa

from store.audit import AuditFilters, AuditStore
from tests.store.audit.test_store import T0, make_record

NUM_RECORDS = 30
INJECTIONS = ["' OR '1'='1", "'; DROP TABLE audit_records; --", '" OR ""="', "%", "_", "\\", "a%' --",
              "1; SELECT pg_sleep(5)", "\x00", "' UNION SELECT * FROM api_keys --", "\u2028", ",", "*"]


@pytest.fixture
def seeded(engine, tmp_path) -> tuple[AuditStore, list[dict]]:
    audit = AuditStore(engine, spool_path=tmp_path / "audit.spool")
    records = [make_record(i) for i in range(NUM_RECORDS)]
    records[7]["input_content"] = "literal 50%_off sale"
    records[8]["policy"] = [{"rule": "secrets", "category": "credentials", "action": "block", "score": 1.0},
                            {"rule": "pii", "category": "pii", "action": "redact", "score": 0.5}]
    records[9]["finish_reason"] = "length"
    for record in records:
        record["id"] = audit.write(record)
    return audit, records


def ids_of(audit: AuditStore, filters: AuditFilters) -> set[str]:
    return {r["id"] for r in audit.query(filters, limit=500).records}


def expect(records: list[dict], keep) -> set[str]:
    return {r["id"] for r in records if keep(r)}


@pytest.mark.parametrize(("filters", "keep"), [
    (AuditFilters(), lambda r: True),
    (AuditFilters(since=T0 + timedelta(minutes=10)), lambda r: r["received_at"] >= T0 + timedelta(minutes=10)),
    (AuditFilters(until=T0 + timedelta(minutes=10)), lambda r: r["received_at"] < T0 + timedelta(minutes=10)),
    (AuditFilters(pipeline="rag"), lambda r: r["pipeline"] == "rag"),
    (AuditFilters(spec_sha256=f"{2:064d}"), lambda r: r["spec_sha256"] == f"{2:064d}"),
    (AuditFilters(key_id="key000000001"), lambda r: r["key_id"] == "key000000001"),
    (AuditFilters(model="big"), lambda r: r["model"] == "big"),
    (AuditFilters(policy_action="redact"), lambda r: bool(r["policy"]) and r["policy"][0]["action"] == "redact"),
    (AuditFilters(policy_action="block"), lambda r: any(p["action"] == "block" for p in r["policy"])),
    (AuditFilters(policy_category="pii"), lambda r: any(p["category"] == "pii" for p in r["policy"])),
    (AuditFilters(policy_category="credentials"), lambda r: any(p["category"] == "credentials" for p in r["policy"])),
    (AuditFilters(policy_category="pi"), lambda r: False),
    (AuditFilters(status="denied"), lambda r: r["status"] == "denied"),
    (AuditFilters(finish_reason="length"), lambda r: r["finish_reason"] == "length"),
    (AuditFilters(min_cost_usd=0.003), lambda r: r["cost_usd"] >= 0.003),
    (AuditFilters(text="ANSWER 1"), lambda r: "answer 1" in r["output_content"]),
    (AuditFilters(text="50%_"), lambda r: "50%_" in r["input_content"]),
    (AuditFilters(text="%"), lambda r: "%" in r["input_content"] + r["output_content"]),
    (AuditFilters(text="reset 100%"), lambda r: "reset 100%" in r["input_content"]),
    (AuditFilters(pipeline="support", status="ok", model="smol"),
     lambda r: (r["pipeline"], r["status"], r["model"]) == ("support", "ok", "smol")),
])
def test_each_filter_selects_what_it_says(seeded, filters, keep):
    audit, records = seeded
    assert ids_of(audit, filters) == expect(records, keep)


@pytest.mark.parametrize("sort", ["received_at", "-received_at", "cost_usd", "-cost_usd", "duration_ms",
                                  "-duration_ms", "seq", "-seq"])
def test_pagination_covers_every_record_once_in_order(seeded, sort):
    audit, records = seeded
    seen, cursor = [], None
    while True:
        page = audit.query(AuditFilters(), sort=sort, cursor=cursor, limit=7)
        seen += page.records
        cursor = page.next_cursor
        if cursor is None:
            break
    assert sorted(r["id"] for r in seen) == sorted(r["id"] for r in records)
    name, reverse = sort.lstrip("-"), sort.startswith("-")
    keys = [(r[name], r["seq"]) for r in seen]
    assert keys == sorted(keys, reverse=reverse)


def test_pagination_with_a_filter(seeded):
    audit, records = seeded
    first = audit.query(AuditFilters(pipeline="support"), sort="-cost_usd", limit=10)
    rest = audit.query(AuditFilters(pipeline="support"), sort="-cost_usd", limit=10, cursor=first.next_cursor)
    assert rest.next_cursor is None
    assert {r["id"] for r in first.records + rest.records} == expect(records, lambda r: r["pipeline"] == "support")


@pytest.mark.parametrize("sort", ["id", "received_at;DROP TABLE audit_records", "-", "", "input_content", None])
def test_unknown_sorts_are_value_errors(seeded, sort):
    with pytest.raises(ValueError, match="sort"):
        seeded[0].query(AuditFilters(), sort=sort)


@pytest.mark.parametrize("cursor", ["", "!!!", "bm90IGpzb24", "WyJzZXEiXQ", "WyItc2VxIiwgMSwgMl0"])
def test_bad_cursors_are_value_errors(seeded, cursor):
    with pytest.raises(ValueError, match="cursor"):
        seeded[0].query(AuditFilters(), sort="-received_at", cursor=cursor)


@pytest.mark.parametrize("limit", [0, -1, 501, 1.5])
def test_limits_are_bounded(seeded, limit):
    with pytest.raises(ValueError, match="limit"):
        seeded[0].query(AuditFilters(), limit=limit)


@pytest.mark.parametrize("name", ["pipeline", "spec_sha256", "key_id", "model", "policy_action", "policy_category",
                                  "status", "finish_reason", "text"])
def test_injection_strings_match_nothing_and_break_nothing(seeded, name):
    audit, _ = seeded
    for value in INJECTIONS:
        filters = AuditFilters(**{name: value})
        found = ids_of(audit, filters)
        if name == "text" and value in ("%", "_", ","):
            continue  # literal characters that some contents do contain
        assert found == set(), (name, value)
        assert audit.summary(filters, "pipeline") == []
        assert list(audit.export(filters, "jsonl")) == []
    assert len(ids_of(audit, AuditFilters())) == NUM_RECORDS
    assert audit.verify().ok


def test_export_jsonl_and_csv_parse_back(seeded):
    audit, records = seeded
    filters = AuditFilters(pipeline="support")
    rows = [json.loads(line) for line in audit.export(filters, "jsonl")]
    assert [r["id"] for r in rows] == [r["id"] for r in records if r["pipeline"] == "support"]
    assert rows[0]["stages"][0]["stage_id"] == "guard"
    table = list(csv.DictReader(io.StringIO("".join(audit.export(filters, "csv")))))
    assert [r["id"] for r in table] == [r["id"] for r in rows]
    assert json.loads(table[0]["params"]) == rows[0]["params"]
    assert table[3]["input_content"] == rows[3]["input_content"]
    with pytest.raises(ValueError):
        audit.export(filters, "xml")


def test_export_streams_past_one_batch(seeded, monkeypatch):
    import store.audit.query

    monkeypatch.setattr(store.audit.query, "EXPORT_BATCH", 4)
    assert len(list(seeded[0].export(AuditFilters(), "jsonl"))) == NUM_RECORDS


@pytest.mark.parametrize("group_by", ["pipeline", "model", "key_id", "day"])
def test_summary_adds_up(seeded, group_by):
    audit, records = seeded
    groups = audit.summary(AuditFilters(), group_by)
    assert sum(g["count"] for g in groups) == NUM_RECORDS
    assert sum(g["denied"] for g in groups) == sum(r["status"] == "denied" for r in records)
    assert sum(g["input_tokens"] for g in groups) == sum(r["input_tokens"] for r in records)
    assert sum(g["cost_usd"] for g in groups) == pytest.approx(sum(r["cost_usd"] for r in records))
    for group in groups:
        assert group["block_rate"] == pytest.approx(group["denied"] / group["count"])
    if group_by == "day":
        assert [g["day"] for g in groups] == ["2026-01-01"]
    with pytest.raises(ValueError):
        audit.summary(AuditFilters(), "status")


def test_records_are_json_able(seeded):
    page = seeded[0].query(AuditFilters(), limit=3)
    json.dumps(page.records)
    assert page.records[0]["received_at"].endswith("+00:00")


def test_access_is_logged(seeded):
    audit, _ = seeded
    audit.log_access("key000000001", "auditor", "query", {"pipeline": "rag", "since": T0})
    audit.log_access(None, None, "export", {"format": "csv"})
    log = audit.access_log(10)
    assert [entry["action"] for entry in log] == ["export", "query"]
    assert log[1]["query"] == {"pipeline": "rag", "since": str(T0)}
    assert log[1]["key_id"] == "key000000001"


def test_prune_markers_are_not_requests(seeded):
    audit, _ = seeded
    audit.prune({"support": 0}, now=T0 + timedelta(days=1))
    assert {r["kind"] for r in audit.query(AuditFilters(), limit=500).records} == {"record"}
    assert [r["kind"] for r in audit.query(AuditFilters(kind="prune")).records] == ["prune"]
    with audit.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM audit_stages")) == 2 * NUM_RECORDS // 2
