"""The audit record's shape and its hash: ids, validation, canonical JSON, signatures.

Pure functions, no database: the writer (store/audit/writer.py) and the verifier
(store/audit/verify.py) must compute byte-identical canonical forms, so both
go through :func:`record_hash` over the values as the database returns them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from store.audit.models import CONTENT_MODES, STATUSES, AuditRecord, AuditStage
from store.audit.signing import Signer, as_signer, checkpoint_message

#: Columns hashed into the chain: all but ``hash`` and ``legal_hold`` (holds change after the fact).
HASHED_COLUMNS = (
    "id", "seq", "prev_hash", "kind", "received_at", "first_token_at", "completed_at", "duration_ms", "ttft_ms",
    "key_id", "role", "client_addr", "pipeline", "pipeline_version", "spec_sha256", "model", "weights_hash",
    "params", "input_tokens", "output_tokens", "cost_usd", "route", "retrieval", "policy", "policy_action",
    "policy_categories", "status", "finish_reason", "http_status", "error_type", "content_mode",
    "input_content", "output_content", "request_id", "trace_id", "pruned", "tags", "subject_hash",
)
#: Columns added after records were first chained: left out of the canonical form while NULL, so that a
#: record chained before them hashes as it did.
_LATER_COLUMNS = ("tags", "subject_hash")
_FIRST_COLUMNS = tuple(name for name in HASHED_COLUMNS if name not in _LATER_COLUMNS)
#: A stage row's columns, chained in its record's hash; ``step`` (revision 0013) only when set, so that a stage
#: row without one (every row written before it, a shadow's) hashes as it did.
STAGE_COLUMNS = ("stage_id", "type", "status", "duration_ms", "cost_usd", "decision", "step")
_FIRST_STAGE_COLUMNS = STAGE_COLUMNS[:-1]
_FIRST_STAGE_KEYS = frozenset(_FIRST_STAGE_COLUMNS)
_STAGE_KEYS = frozenset(STAGE_COLUMNS)
_ROW_KEYS = frozenset((*HASHED_COLUMNS, "hash", "legal_hold"))
_DATETIMES = ("received_at", "first_token_at", "completed_at")
_FLOATS = ("duration_ms", "ttft_ms", "cost_usd")
_INTS = ("input_tokens", "output_tokens", "http_status")
_JSONS = ("params", "route", "retrieval", "policy", "pruned")
_STRINGS = ("key_id", "role", "client_addr", "pipeline", "pipeline_version", "spec_sha256", "model",
            "weights_hash", "policy_action", "policy_categories", "status", "finish_reason", "error_type",
            "content_mode", "input_content", "output_content", "request_id", "trace_id", "tags", "subject_hash")
_NOT_NULL_STRINGS = {"pipeline": "", "pipeline_version": "", "spec_sha256": "", "policy_categories": "",
                     "input_content": "", "output_content": ""}
#: What a writer may pass: the columns it owns, plus ``stages``. seq, hashes and holds are the store's.
ACCEPTED_KEYS = frozenset(HASHED_COLUMNS) - {"seq", "prev_hash", "kind", "pruned"} | {"stages"}
_MAX_LENGTHS = {column.name: column.type.length for column in (*AuditRecord.__table__.columns,
                                                                 *AuditStage.__table__.columns)
                if isinstance(column.type, sa.String) and column.type.length}
# One encoder, reused: json.dumps with options builds a new one per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
# Strongest first: policy_action is derived from these when the writer leaves it out.
_ACTION_STRENGTH = {"block": 4, "deny": 4, "redact": 2, "flag": 1, "allow": 0}


def uuid7() -> str:
    """A new RFC 9562 UUIDv7: 48-bit Unix ms timestamp, version 7, variant 10, 74 random bits."""
    value = (time.time_ns() // 1_000_000 & (1 << 48) - 1) << 80 | int.from_bytes(os.urandom(10)) & (1 << 80) - 1
    value = value & ~(0xF << 76) | 0x7 << 76  # version nibble
    value = value & ~(0x3 << 62) | 0x2 << 62  # RFC 9562 variant
    return str(uuid.UUID(int=value))


def normalize(record: Mapping[str, Any], now: datetime) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Row values and stage rows of *record*, typed as the database will return them.

    Raises ValueError for unknown keys or values of the wrong kind: such a record
    is a bug in the writer, and spooling it would only defer the failure.
    """
    unknown = set(record) - ACCEPTED_KEYS
    if unknown:
        raise ValueError(f"unknown audit record field(s): {', '.join(sorted(unknown))}")
    row: dict[str, Any] = {name: record.get(name) for name in HASHED_COLUMNS if name in ACCEPTED_KEYS}
    row["id"] = _record_id(record.get("id"))
    row["kind"], row["pruned"] = "record", None
    row["completed_at"] = _datetime("completed_at", row["completed_at"]) or now
    row["received_at"] = _datetime("received_at", row["received_at"]) or row["completed_at"]
    row["first_token_at"] = _datetime("first_token_at", row["first_token_at"])
    for name in _FLOATS:
        row[name] = _number(name, row[name], float)
    for name in _INTS:
        row[name] = _number(name, row[name], int)
    row["duration_ms"] = row["duration_ms"] or 0.0
    row["cost_usd"] = row["cost_usd"] or 0.0
    row["input_tokens"], row["output_tokens"] = row["input_tokens"] or 0, row["output_tokens"] or 0
    row["params"] = row["params"] or {}
    row["policy"] = row["policy"] or []
    for name in _JSONS:
        row[name] = _json(name, row[name])
    _derive_policy(row)
    row["status"] = row["status"] or "ok"
    row["content_mode"] = row["content_mode"] or "hash"
    for name in _STRINGS:
        row[name] = _string(name, row[name], _NOT_NULL_STRINGS.get(name))
    _check_choice("status", row["status"], STATUSES)
    _check_choice("content_mode", row["content_mode"], CONTENT_MODES)
    return row, [_stage(stage) for stage in record.get("stages") or ()]


def canonical(row: Mapping[str, Any], stages: Sequence[Mapping[str, Any]]) -> str:
    """Sorted keys, no whitespace, UTC ISO timestamps with microseconds, floats as repr, stages in order."""
    if row.keys() == _ROW_KEYS:  # a whole row, as verify reads it: copying is cheaper than picking
        body = dict(row)
        del body["hash"], body["legal_hold"]
    else:
        body = {name: row[name] for name in _FIRST_COLUMNS}
        body.update((name, row.get(name)) for name in _LATER_COLUMNS)
    for name in _LATER_COLUMNS:
        if body[name] is None:
            del body[name]
    for name in _DATETIMES:
        if isinstance(body[name], datetime):  # verify may pass the text already formatted
            body[name] = utc_text(body[name])
    # A stage row as verify reads it is taken as it is (copying is cheaper than picking).
    body["stages"] = [stage if stage.keys() == _FIRST_STAGE_KEYS else _stage_body(stage) for stage in stages]
    return _CANONICAL.encode(body)


def _stage_body(stage: Mapping[str, Any]) -> Mapping[str, Any]:
    """A stage row as the chain covers it: its first six columns, and its ``step`` when it has one."""
    if stage.keys() == _STAGE_KEYS and stage["step"] is not None:
        return stage
    body = {name: stage[name] for name in _FIRST_STAGE_COLUMNS}
    if stage.get("step") is not None:
        body["step"] = stage["step"]
    return body


def utc_text(value: datetime) -> str:
    """2026-01-01T12:00:00.000000Z: UTC, microseconds always, the canonical form of a timestamp."""
    return value.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def record_hash(prev_hash: str, row: Mapping[str, Any], stages: Sequence[Mapping[str, Any]]) -> str:
    """The chain hash: SHA-256 of prev_hash followed by the canonical JSON."""
    return hashlib.sha256((prev_hash + canonical(row, stages)).encode()).hexdigest()


def hashed_canonical(prev_hash: str, row: Mapping[str, Any], stages: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """:func:`record_hash` and the canonical JSON it covers (which the PostgreSQL append sends as the row)."""
    text = canonical(row, stages)
    return hashlib.sha256((prev_hash + text).encode()).hexdigest(), text


def sign_checkpoint(key: bytes | Signer, seq: int, head_hash: str) -> str:
    """The signature over ``"<seq>:<head_hash>"``, hex: Ed25519 with a signer, HMAC-SHA256 with bytes."""
    return as_signer(key).sign(checkpoint_message(seq, head_hash))


def checkpoint_row(key: bytes | Signer, seq: int, head_hash: str, now: datetime) -> dict[str, Any]:
    """The audit_checkpoints row that signs the chain head at *seq*, naming the algorithm and key."""
    signer = as_signer(key)
    return {"seq": seq, "head_hash": head_hash, "signature": signer.sign(checkpoint_message(seq, head_hash)),
            "algorithm": signer.algorithm, "key_id": signer.key_id, "created_at": now}


def row_to_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """A record as JSON-able values: datetimes become ISO strings."""
    return {name: value.isoformat() if isinstance(value, datetime) else value for name, value in row.items()}


def json_line(row: Mapping[str, Any], stages: Sequence[Mapping[str, Any]]) -> str:
    """A normalized record as one JSON line (no seq): the spool's format."""
    record = row_to_dict({name: value for name, value in row.items() if name not in ("kind", "pruned")})
    record["stages"] = list(stages)
    return json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"


def _record_id(value: Any) -> str:
    if value is None:
        return uuid7()
    if not isinstance(value, str) or not 0 < len(value) <= 36:
        raise ValueError("audit record id must be a string of 1 to 36 characters")
    return value


def _datetime(name: str, value: Any) -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{name}: not an ISO 8601 timestamp: {value[:40]!r}") from None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValueError(f"{name}: expected a timezone-aware datetime")
    return value.astimezone(UTC)


def _number(name: str, value: Any, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__}")
    number = kind(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: {value!r} is not a finite number")
    return number


def _json(name: str, value: Any) -> Any:
    if _is_plain_json(value, 0):
        return value  # what the round trip below would give back, for a tenth of the time
    # A JSON round trip: tuples become lists, keys strings, exactly as the database returns them.
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: not JSON-serialisable: {exc}") from None


def _is_plain_json(value: Any, depth: int) -> bool:
    """Whether *value* is made of exactly dict (str keys), list, str, int, bool, finite float and None."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return value - value == 0.0  # not NaN or infinite, which JSON cannot hold
    if depth > 32:  # deeper: leave it to json, which knows about recursion
        return False
    if kind is dict:
        return all(type(key) is str and _is_plain_json(item, depth + 1) for key, item in value.items())
    if kind is list:
        return all(_is_plain_json(item, depth + 1) for item in value)
    return False


def _string(name: str, value: Any, default: str | None) -> str | None:
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
    limit = _MAX_LENGTHS.get(name)
    if limit is not None and len(value) > limit:
        # PostgreSQL would refuse it and SQLite would not: refuse it the same way on both.
        raise ValueError(f"{name}: {len(value)} characters; at most {limit} allowed")
    # PostgreSQL text cannot hold NUL; replace rather than lose the record.
    return value.replace("\x00", "\ufffd")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


def _derive_policy(row: dict[str, Any]) -> None:
    decisions = [d for d in row["policy"] if isinstance(d, dict)]
    if row["policy_action"] is None and decisions:
        actions = [str(d.get("action", "")) for d in decisions]
        row["policy_action"] = max(actions, key=lambda action: _ACTION_STRENGTH.get(action, -1))
    if row["policy_categories"] is None:
        row["policy_categories"] = ",".join(sorted({str(d["category"]) for d in decisions if d.get("category")}))


def _stage(stage: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(stage, Mapping):
        raise ValueError("stages: each stage must be a mapping")
    return {"stage_id": _string("stage_id", stage.get("stage_id"), ""), "type": _string("type", stage.get("type"), ""),
            "status": _string("status", stage.get("status"), ""),
            "duration_ms": _number("duration_ms", stage.get("duration_ms"), float) or 0.0,
            "cost_usd": _number("cost_usd", stage.get("cost_usd"), float) or 0.0,
            "decision": _json("decision", stage.get("decision")), "step": _step(stage.get("step"))}


def _step(value: Any) -> dict[str, Any] | None:
    """A stage row's ``step``: None, or a JSON object as the database returns it."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"step: expected a JSON object, got {type(value).__name__}")
    return _json("step", dict(value))

