"""Reading the audit log: filters, keyset pagination, summaries and streamed exports.

Every filter value reaches the database as a bound parameter; LIKE patterns
are escaped (``autoescape``), and sort fields come from an allow-list, so no
caller-supplied text is ever part of the SQL.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import csv
import io
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa

from store.audit.chain import STAGE_COLUMNS, row_to_dict
from store.audit.filters import AuditFilters, SubjectMatch, parse_cost
from store.audit.models import AuditRecord, AuditStage
from store.audit.vault import PREFIX
from store.keys import ApiKey

MAX_LIMIT = 500
EXPORT_BATCH = 1000
_records = AuditRecord.__table__
_stages = AuditStage.__table__
_keys = ApiKey.__table__
# The key's name beside its id; a deleted or unknown key has none.
_WITH_KEY = _records.outerjoin(_keys, _keys.c.id == _records.c.key_id)
_KEY_NAME = _keys.c.name.label("key_name")
SORT_FIELDS = {name: _records.c[name] for name in ("received_at", "cost_usd", "duration_ms", "seq")}
GROUPS = ("pipeline", "model", "key_id", "day")
RECORD_COLUMNS = tuple(column.name for column in _records.columns)
#: An export's columns: the record's, then the name of its key (not part of the hashed record).
EXPORT_COLUMNS = (*RECORD_COLUMNS, "key_name")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Page:
    """One page of records and the cursor of the next page (None on the last one)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    next_cursor: str | None = None


def conditions(filters: AuditFilters) -> list[sa.ColumnElement[bool]]:
    """The WHERE clauses of *filters*, with bound values only."""
    c = _records.c
    where: list[sa.ColumnElement[bool]] = []
    if filters.since is not None:
        where.append(c.received_at >= filters.since)
    if filters.until is not None:
        where.append(c.received_at < filters.until)
    for name in ("pipeline", "spec_sha256", "key_id", "model", "policy_action", "status", "finish_reason", "kind"):
        value = getattr(filters, name)
        if value is not None:
            where.append(c[name] == _text(value))
    if filters.policy_category is not None:
        categories = sa.literal(",") + c.policy_categories + sa.literal(",")
        where.append(categories.contains(f",{_text(filters.policy_category)},", autoescape=True))
    if filters.min_cost_usd is not None:
        where.append(c.cost_usd >= parse_cost(filters.min_cost_usd))
    if filters.text:
        text = _text(filters.text)
        where.append(sa.or_(c.input_content.icontains(text, autoescape=True),
                            c.output_content.icontains(text, autoescape=True)))
    if filters.subject is not None:
        if filters.subject_match is None:
            raise ValueError("subject: its records are found by its keyed hash, which needs audit.master_key")
        where.append(of_subject(filters.subject_match))
    return where


def of_subject(match: SubjectMatch) -> sa.ColumnElement[bool]:
    """The records of a subject: those that keep its keyed hash, and those encrypted under its data keys."""
    c = _records.c
    return sa.or_(c.subject_hash == match.subject_hash,
                  *(c.input_content.startswith(f"{PREFIX}{key_id}:", autoescape=True) for key_id in match.key_ids))


def query_page(conn: sa.Connection, filters: AuditFilters, sort: str, cursor: str | None, limit: int) -> Page:
    """One page of records matching *filters*, ordered by *sort* (``-`` prefix: descending)."""
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}")
    name, descending = parse_sort(sort)
    column, seq = SORT_FIELDS[name], _records.c.seq
    statement = sa.select(_records, _KEY_NAME).select_from(_WITH_KEY).where(*conditions(filters))
    if cursor is not None:
        value, after_seq = _decode_cursor(cursor, sort)
        if name == "seq":
            statement = statement.where(seq < after_seq if descending else seq > after_seq)
        elif descending:
            statement = statement.where(sa.or_(column < value, sa.and_(column == value, seq < after_seq)))
        else:
            statement = statement.where(sa.or_(column > value, sa.and_(column == value, seq > after_seq)))
    order = (column.desc(), seq.desc()) if descending else (column.asc(), seq.asc())
    rows = [dict(row) for row in conn.execute(statement.order_by(*order).limit(limit + 1)).mappings()]
    next_cursor = _encode_cursor(sort, rows[limit - 1][name], rows[limit - 1]["seq"]) if len(rows) > limit else None
    return Page([shown(row_to_dict(row)) for row in rows[:limit]], next_cursor)


def parse_sort(sort: str) -> tuple[str, bool]:
    """(field, descending) of *sort*; ValueError for a field outside SORT_FIELDS."""
    name = sort[1:] if isinstance(sort, str) and sort.startswith("-") else sort
    if name not in SORT_FIELDS:
        raise ValueError(f"cannot sort by {sort!r}; allowed: {', '.join(SORT_FIELDS)} (prefix - for descending)")
    return name, sort.startswith("-")


def summarize(conn: sa.Connection, filters: AuditFilters, group_by: str) -> list[dict[str, Any]]:
    """Per-group count, denied count, block rate, tokens and cost."""
    if group_by not in GROUPS:
        raise ValueError(f"cannot group by {group_by!r}; allowed: {', '.join(GROUPS)}")
    c = _records.c
    key = day_column(conn.dialect.name) if group_by == "day" else c[group_by]
    by_key = group_by == "key_id"
    denied = sa.func.sum(sa.case((c.status == "denied", 1), else_=0))
    statement = (sa.select(key.label("key"), sa.func.count().label("count"), denied.label("denied"),
                           sa.func.sum(c.input_tokens).label("input_tokens"),
                           sa.func.sum(c.output_tokens).label("output_tokens"),
                           sa.func.sum(c.cost_usd).label("cost_usd"), *([_KEY_NAME] if by_key else []))
                 .select_from(_WITH_KEY if by_key else _records).where(*conditions(filters))
                 .group_by(key, *([_keys.c.name] if by_key else [])).order_by(key))
    return [{group_by: row.key, **({"key_name": row.key_name} if by_key else {}), "count": row.count,
             "denied": int(row.denied or 0), "block_rate": (row.denied or 0) / row.count,
             "input_tokens": int(row.input_tokens or 0), "output_tokens": int(row.output_tokens or 0),
             "cost_usd": float(row.cost_usd or 0.0)}
            for row in conn.execute(statement)]


def export_lines(engine: sa.Engine, filters: AuditFilters, fmt: Literal["jsonl", "csv"]) -> Iterator[str]:
    """Matching records in seq order with their stages, one line at a time."""
    if fmt not in ("jsonl", "csv"):
        raise ValueError(f"unknown export format {fmt!r}; use jsonl or csv")
    if fmt == "csv":
        yield _csv_line([*EXPORT_COLUMNS, "stages"])
    after = 0
    while True:
        # A connection per batch: a slow reader must not hold one for the whole export.
        with engine.connect() as conn:
            statement = (sa.select(_records, _KEY_NAME).select_from(_WITH_KEY)
                         .where(*conditions(filters), _records.c.seq > after)
                         .order_by(_records.c.seq).limit(EXPORT_BATCH))
            rows = [shown(row_to_dict(dict(row))) for row in conn.execute(statement).mappings()]
            stages = stages_of(conn, [row["id"] for row in rows])
        if not rows:
            return
        for row in rows:
            row["stages"] = stages.get(row["id"], [])
            yield json.dumps(row, separators=(",", ":")) + "\n" if fmt == "jsonl" else _csv_row(row)
        after = rows[-1]["seq"]


def get_record(conn: sa.Connection, record_id: str) -> dict[str, Any] | None:
    """One record with its key's name and its ``stages`` list; None if there is no such record."""
    statement = sa.select(_records, _KEY_NAME).select_from(_WITH_KEY).where(_records.c.id == record_id)
    row = conn.execute(statement).mappings().first()
    if row is None:
        return None
    found = shown(row_to_dict(dict(row)))
    found["stages"] = stages_of(conn, [record_id]).get(record_id, [])
    return found


def find_record_id(conn: sa.Connection, ident: str) -> str | None:
    """The id of the record of the request whose request id is *ident*, or else whose trace id is (32 hex
    digits); None if there is none."""
    # request_id is indexed; trace_id is not, so it is looked up only when the request id finds nothing.
    found = conn.scalar(sa.select(_records.c.id).where(_records.c.request_id == ident).limit(1))
    if found is None and _TRACE_ID.fullmatch(ident):
        found = conn.scalar(sa.select(_records.c.id).where(_records.c.trace_id == ident).limit(1))
    return found


def shown(record: dict[str, Any]) -> dict[str, Any]:
    """*record* as reviewers read it: its ``tags`` as an object (they are stored as JSON text), or, encrypted,
    the ciphertext (which the reader's ``reveal`` decrypts)."""
    tags = record.get("tags")
    if isinstance(tags, str) and not tags.startswith(PREFIX):
        with contextlib.suppress(ValueError):  # not JSON (written by hand): shown as stored
            record["tags"] = json.loads(tags)
    return record


def stages_of(conn: sa.Connection, record_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The stages of each record in *record_ids*, in pipeline order."""
    found: dict[str, list[dict[str, Any]]] = {}
    if not record_ids:
        return found
    statement = (sa.select(_stages.c.record_id, *(_stages.c[name] for name in STAGE_COLUMNS))
                 .where(_stages.c.record_id.in_(record_ids)).order_by(_stages.c.record_id, _stages.c.position))
    for row in conn.execute(statement).mappings():
        stage = dict(row)
        found.setdefault(stage.pop("record_id"), []).append(stage)
    return found


def _text(value: object) -> str:
    # Stored text had NUL replaced (PostgreSQL refuses it); a filter must match the same way.
    return str(value).replace("\x00", "\ufffd")


def day_column(dialect: str) -> sa.ColumnElement[Any]:
    """A record's day of arrival (UTC) as YYYY-MM-DD."""
    if dialect == "sqlite":  # stored as naive UTC text
        return sa.func.strftime("%Y-%m-%d", _records.c.received_at)
    return sa.func.to_char(sa.func.timezone("UTC", _records.c.received_at), "YYYY-MM-DD")


def _encode_cursor(sort: str, value: Any, seq: int) -> str:
    payload = [sort, value.isoformat() if isinstance(value, datetime) else value, seq]
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str, sort: str) -> tuple[Any, int]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        cursor_sort, value, seq = json.loads(raw)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ValueError("invalid cursor") from None
    if cursor_sort != sort or not isinstance(seq, int):
        raise ValueError("invalid cursor: it belongs to another sort order")
    if sort.lstrip("-") == "received_at":
        try:
            value = datetime.fromisoformat(value)
        except (TypeError, ValueError):
            raise ValueError("invalid cursor") from None
        if value.tzinfo is None:
            raise ValueError("invalid cursor")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("invalid cursor")
    return value, seq


def _csv_row(row: dict[str, Any]) -> str:
    return _csv_line(["" if row[name] is None else json.dumps(row[name]) if isinstance(row[name], dict | list)
                      else row[name] for name in (*EXPORT_COLUMNS, "stages")])


def _csv_line(values: Sequence[Any]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(values)
    return buffer.getvalue()
