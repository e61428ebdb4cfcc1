"""Each step of a workflow in its record (revision 0013): the stage rows' ``step`` kept through every write path,
read back, exported, chained only when set, and found when tampered with. On SQLite and, marked
``integration``, on PostgreSQL (whose one-round-trip append stores it through ``audit_append()``)."""

from __future__ import annotations

import copy
import csv
import functools
import io
import json

import pytest
import sqlalchemy as sa

import store.audit.writer
from store.audit import AuditFilters, AuditStore, Journal
from store.audit.chain import canonical, json_line, normalize, record_hash
from store.db import utcnow
from store.engine import make_engine
from tests.store.audit.test_append import calls_to_audit_append
from tests.store.audit.test_store import T0, execute, kinds, make_record

AWKWARD = "é\n\t\"\\ \u2028 \U0001f600 </script>"
CLASSIFY_INPUTS = {"input": AWKWARD, "messages": [{"role": "user", "content": AWKWARD}]}
#: A workflow's stage rows as stages/audit.py builds them (content: full): a retried step, a skipped branch, and
#: a shadow row, which has no step.
STAGES = [
    {"stage_id": "classify", "type": "llm", "status": "failed", "duration_ms": 3.5, "cost_usd": 0.001,
     "step": {"attempt": 1, "started_ms": 0.125, "definition_sha256": "d" * 64, "inputs_sha256": "1" * 64,
              "input_tokens": 12, "output_tokens": 4, "inputs": CLASSIFY_INPUTS}},
    {"stage_id": "classify", "type": "llm", "status": "ok", "duration_ms": 2.25, "cost_usd": 0.001,
     "step": {"attempt": 2, "started_ms": 3.75, "definition_sha256": "d" * 64, "inputs_sha256": "1" * 64,
              "output_sha256": "2" * 64, "input_tokens": 12, "output_tokens": 9, "inputs": CLASSIFY_INPUTS,
              "output": {"output": {"intent": "tech", "amount": 1e300, "tiny": 1.5e-07, "big": 2**70},
                         "text": AWKWARD, "finish_reason": "stop"}}},
    {"stage_id": "refund", "type": "llm", "status": "skipped", "duration_ms": 0.0, "cost_usd": 0.0,
     "step": {"attempt": 1, "started_ms": 6.0, "skip_reason": "when", "definition_sha256": "e" * 64}},
    {"stage_id": "shadow", "type": "shadow", "status": "ok", "decision": {"of": "req-0"}},
]
#: What the database gives back for each stage row's step.
STEPS = [stage.get("step") for stage in STAGES]


def stepped(i: int, **overrides):
    return make_record(i, stages=copy.deepcopy(STAGES), **overrides)


def steps_of(audit: AuditStore, record_id: str) -> list:
    return [stage["step"] for stage in audit.get(record_id)["stages"]]


@pytest.fixture
def audit(engine, tmp_path) -> AuditStore:
    return AuditStore(engine, spool_path=tmp_path / "spool" / "audit.jsonl", checkpoint_key=b"k" * 32,
                      checkpoint_every=5)


# --- the chain -------------------------------------------------------------------------------------------------


def test_a_stage_row_without_a_step_hashes_as_it_did_before_revision_0013():
    row, stages = normalize(make_record(0, id="0190aaaa-0000-7000-8000-000000000000"), T0)
    row.update(seq=1, prev_hash="0" * 64)
    assert [stage["step"] for stage in stages] == [None, None]
    assert all("step" not in stage for stage in json.loads(canonical(row, stages))["stages"])
    # The hash the code before revision 0013 (and 0012) gave this very record, its stage rows included.
    pinned = "409b02e7f9301a9d30359506e837837e65499516b673fd9bc293cbf57b0406df"
    assert record_hash("0" * 64, row, stages) == pinned
    assert record_hash("0" * 64, row, [{k: v for k, v in s.items() if k != "step"} for s in stages]) == pinned
    with_step = [{**stages[0], "step": {"attempt": 1, "started_ms": 0.0}}, stages[1]]
    assert json.loads(canonical(row, with_step))["stages"][0]["step"] == {"attempt": 1, "started_ms": 0.0}
    assert record_hash("0" * 64, row, with_step) != pinned


@pytest.mark.parametrize("step", ["attempt 2", ["attempt", 2], 2, {"bad": float("nan")}])
def test_a_step_that_is_not_a_json_object_is_refused(step):
    with pytest.raises(ValueError, match="step"):
        normalize(make_record(0, stages=[{"stage_id": "a", "step": step}]), utcnow())


# --- each write path -------------------------------------------------------------------------------------------


def test_the_write_keeps_each_step(audit):
    # SQLite: the locking append; PostgreSQL: audit_append() in one round trip.
    sent = calls_to_audit_append(audit.engine)
    record_id = audit.write(stepped(0))
    assert len(sent) == (audit.engine.dialect.name == "postgresql")
    assert steps_of(audit, record_id) == STEPS
    assert audit.verify().ok


def test_write_many_keeps_each_step(audit):
    ids = audit.write_many([stepped(i) for i in range(3)])
    assert [steps_of(audit, record_id) for record_id in ids] == [STEPS] * 3
    assert audit.verify().ok


async def test_the_event_loop_write_keeps_each_step(audit, monkeypatch):
    # SQLite: the loop writer (a file database); PostgreSQL: the async connection's audit_append().
    monkeypatch.setattr(audit.writer, "_write_items", None)  # not the blocking path, in a thread
    try:
        ids = await audit.awrite_batch([stepped(0), stepped(1)])
    finally:
        await audit.aclose()
    assert [steps_of(audit, record_id) for record_id in ids] == [STEPS, STEPS]
    assert audit.verify().ok


def test_the_spool_keeps_each_step_and_replays_it_once(audit, monkeypatch):
    monkeypatch.setattr(store.audit.writer, "RETRY_AFTER_S", 0.0)
    dead = make_engine("postgresql://postgres@127.0.0.1:1/nothing?connect_timeout=2")
    real, audit.engine = audit.engine, dead
    try:
        spooled = audit.write(stepped(0))
    finally:
        audit.engine = real
        dead.dispose()
    line = json.loads(audit.writer._spool.path.read_text())
    assert [stage["step"] for stage in line["stages"]] == STEPS
    assert audit.replay_spool() == 1 and audit.replay_spool() == 0  # through the locking append, on both
    assert steps_of(audit, spooled) == STEPS
    assert audit.verify().ok


def test_a_journal_keeps_each_step_and_replays_it_once(audit, tmp_path):
    journal = Journal.open(tmp_path / "audit-journal")
    items = [normalize(stepped(i), utcnow()) for i in range(2)]
    journal.append([json_line(*item) for item in items])
    path = journal.path
    copied = path.with_name(path.name + ".copy")
    copied.write_bytes(path.read_bytes())
    journal.close()
    assert audit.writer.replay_file(path) == 2
    assert audit.writer.replay_file(copied) == 0  # a journal replayed twice chains its records once
    assert [steps_of(audit, row["id"]) for row, _ in items] == [STEPS, STEPS]
    assert audit.verify().ok


# --- reading ---------------------------------------------------------------------------------------------------


def test_export_carries_each_step(audit):
    audit.write(stepped(0))
    audit.write(make_record(1))  # stages without steps: null
    lines = [json.loads(line) for line in audit.export(AuditFilters(), "jsonl")]
    assert [[stage["step"] for stage in line["stages"]] for line in lines] == [STEPS, [None, None]]
    rows = list(csv.DictReader(io.StringIO("".join(audit.export(AuditFilters(), "csv")))))
    assert [stage["step"] for stage in json.loads(rows[0]["stages"])] == STEPS


# --- tampering -------------------------------------------------------------------------------------------------


@pytest.fixture(params=[1, 3], ids=["one-process", "3-workers"])
def chain(audit, request, monkeypatch) -> AuditStore:
    """Ten records with steps; verify runs here, or in 3 worker processes."""
    for i in range(10):
        audit.write(stepped(i))
    monkeypatch.setattr(audit, "verify", functools.partial(audit.verify, workers=request.param))
    assert audit.verify().ok
    return audit


def _set_step(engine: sa.Engine, seq: int, position: int, step: object) -> None:
    execute(engine, "UPDATE audit_stages SET step = :step WHERE position = :position AND record_id = "
                    "(SELECT id FROM audit_records WHERE seq = :seq)",
            step=None if step is None else json.dumps(step), position=position, seq=seq)


@pytest.mark.parametrize(("position", "step"), [
    (0, {**STEPS[0], "attempt": 2}),                   # the failed attempt passed off as the retry
    (1, {**STEPS[1], "output": {"output": {"intent": "refund"}}}),  # what a step gave, rewritten
    (2, {k: v for k, v in STEPS[2].items() if k != "skip_reason"}),  # why it was skipped, removed
    (1, None),                                           # a step's record erased
    (3, {"attempt": 1, "started_ms": 0.0}),             # a step given to a row that had none
], ids=["attempt", "output", "skip-reason", "erased", "added"])
def test_a_tampered_step_is_modified(chain, position, step, caplog):
    _set_step(chain.engine, 6, position, step)
    assert [(f.kind, f.seq) for f in chain.verify().findings] == [("modified", 6)]
    assert "worker failed" not in caplog.text  # the workers read the steps themselves


def test_a_step_moved_to_another_record_is_modified_twice(chain):
    with chain.engine.connect() as conn:
        moved = conn.execute(sa.text("SELECT s.step FROM audit_stages s JOIN audit_records r ON r.id = s.record_id "
                                     "WHERE r.seq = 2 AND s.position = 2")).scalar_one()
    _set_step(chain.engine, 2, 2, None)
    _set_step(chain.engine, 7, 3, json.loads(moved) if isinstance(moved, str) else moved)
    assert kinds(chain.verify()) == ["modified", "modified"]
