"""Reading the reviewers' access log (``audit_access_log``): who read the audit log, how, and when.

    page = access_page(conn, parse_access_filters({"since": "7d", "action": "export"}), None, 50)
    page.records      # newest first, each with the key's name beside its id
    page.next_cursor  # for the next (older) page, None on the last

The API (``/audit/access``), the CLI (``inferline audit access``) and the console's access page parse
their filters here, so the same filter selects the same entries everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from store.audit.chain import row_to_dict
from store.audit.filters import FILTER_FIELDS, parse_time
from store.audit.models import AuditAccess
from store.audit.query import MAX_LIMIT, Page
from store.keys import ApiKey

#: Each filter of the access log and what it selects.
ACCESS_FIELDS: dict[str, str] = {
    "since": "at or after this time: " + FILTER_FIELDS["since"].split(": ", 1)[1],
    "until": "before this time (same forms as since)",
    "key_id": "public id of the reviewer's API key",
    "action": "query, show, summary, verify, export or access",
}
_access = AuditAccess.__table__
_keys = ApiKey.__table__


@dataclass(frozen=True, slots=True)
class AccessFilters:
    """Which access-log entries to select; every field optional. ``until`` is exclusive."""

    since: datetime | None = None
    until: datetime | None = None
    key_id: str | None = None
    action: str | None = None

    def given(self) -> dict[str, str]:
        """The filters that are set, as JSON-able values, for the access log itself."""
        return {name: (value.isoformat() if isinstance(value, datetime) else value)
                for name in ACCESS_FIELDS if (value := getattr(self, name)) is not None}


def parse_access_filters(values: Mapping[str, str | None]) -> AccessFilters:
    """The filters of text *values*; empty values are unset; ValueError naming an unknown or bad one."""
    parsed: dict[str, object] = {}
    for name, raw in values.items():
        if name not in ACCESS_FIELDS:
            raise ValueError(f"unknown filter {name!r}; allowed: {', '.join(ACCESS_FIELDS)}")
        text = raw.strip() if isinstance(raw, str) else None
        if not text:
            continue
        try:
            parsed[name] = parse_time(text) if name in ("since", "until") else text
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return AccessFilters(**parsed)  # type: ignore[arg-type]


def access_page(conn: sa.Connection, filters: AccessFilters, cursor: str | None, limit: int) -> Page:
    """One page of access-log entries matching *filters*, newest first."""
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}")
    c = _access.c
    where = []
    if filters.since is not None:
        where.append(c.at >= filters.since)
    if filters.until is not None:
        where.append(c.at < filters.until)
    if filters.key_id is not None:
        where.append(c.key_id == filters.key_id)
    if filters.action is not None:
        where.append(c.action == filters.action)
    if cursor is not None:
        if not cursor.isdigit() or len(cursor) > 18:
            raise ValueError("invalid cursor")
        where.append(c.id < int(cursor))
    statement = (sa.select(_access, _keys.c.name.label("key_name"))
                 .select_from(_access.outerjoin(_keys, _keys.c.id == c.key_id))
                 .where(*where).order_by(c.id.desc()).limit(limit + 1))
    rows = [row_to_dict(dict(row)) for row in conn.execute(statement).mappings()]
    next_cursor = str(rows[limit - 1]["id"]) if len(rows) > limit else None
    return Page(rows[:limit], next_cursor)
