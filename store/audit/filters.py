"""The audit log's filters, declared once for every surface that reads the log.

The API (``/audit/*``), the CLI (``inferline audit``) and the console's audit pages all turn their
text inputs into an :class:`AuditFilters` with :func:`parse_filters`, so one filter selects the
same records everywhere:

    parse_filters({"since": "7d", "key_id": "a1B2c3D4e5F6", "min_cost_usd": "0.01"})
    parse_time("2026-12-05")        # 2026-12-05T00:00:00+00:00: a time without an offset is UTC

Times are ISO 8601 (a date, a date and time, with or without an offset) or relative to now:
``30m``, ``24h``, ``7d``, ``2w`` ago, ``today`` and ``yesterday`` (midnight UTC), ``now``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

#: Each filter and what it selects (the help text of the CLI option and of the API parameter).
FILTER_FIELDS: dict[str, str] = {
    "since": "received at or after this time: ISO 8601 (no offset: UTC) or relative (24h, 7d, yesterday)",
    "until": "received before this time (same forms as since)",
    "pipeline": "pipeline name",
    "spec_sha256": "SHA-256 of the pipeline spec that served the request",
    "key_id": "public id of the API key that called",
    "model": "model that answered",
    "policy_action": "strongest policy action: allow, flag, redact or block",
    "policy_category": "a policy category among the record's",
    "status": "ok, denied, failed or disconnected",
    "finish_reason": "why generation stopped (stop, length, ...)",
    "min_cost_usd": "cost in USD at least this (a finite number, 0 or more)",
    "text": "case-insensitive substring of the stored input or output",
    "subject": "the records of one subject of content: encrypted (key:ID, tenant:NAME or tags.FIELD:VALUE), "
               "found by its keyed hash (needs audit.master_key)",
}
#: The filters that make sense for chain verification: a time range.
RANGE_FIELDS = ("since", "until")
TIME_HELP = "ISO 8601 (2026-12-05, 2026-12-05T09:30, with an offset or taken as UTC) or relative (30m, 24h, 7d, 2w, " \
            "today, yesterday, now)"
_RELATIVE = re.compile(r"(\d{1,6})\s*([mhdw])")
_UNITS = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


@dataclass(frozen=True, slots=True)
class SubjectMatch:
    """What finds a subject's records without its name: the keyed hash they keep (``subject_hash``), and the
    ids of its data keys, which name the content of records chained before records kept that hash."""

    subject_hash: str
    key_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AuditFilters:
    """What to select; every field optional, all given ones must hold. ``until`` is exclusive."""

    since: datetime | None = None
    until: datetime | None = None
    pipeline: str | None = None
    spec_sha256: str | None = None
    key_id: str | None = None
    model: str | None = None
    policy_action: str | None = None
    policy_category: str | None = None
    status: str | None = None
    finish_reason: str | None = None
    min_cost_usd: float | None = None
    text: str | None = None
    """Case-insensitive substring of input_content or output_content (wildcards are literal)."""
    kind: str | None = "record"
    """``record`` (requests), ``prune`` (prune markers), or None for both."""
    subject: str | None = None
    """A subject of ``content: encrypted``, as erasure names it; selecting it needs :attr:`subject_match`."""
    subject_match: SubjectMatch | None = None
    """How :attr:`subject`'s records are found, which takes the master key: the reader sets it."""

    def given(self) -> dict[str, str | float]:
        """The filters that are set, as JSON-able values (times in ISO 8601), for the access log (which keeps a
        ``subject`` as its keyed hash only: AuditReader.log_access)."""
        return {name: (value.isoformat() if isinstance(value, datetime) else value)
                for name in FILTER_FIELDS if (value := getattr(self, name)) is not None}


def parse_time(value: str, *, now: datetime | None = None) -> datetime:
    """An aware UTC datetime from ISO 8601 or a relative time (see the module docstring); ValueError else."""
    text = value.strip().lower() if isinstance(value, str) else ""
    now = now or datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if text in ("now", "today", "yesterday"):
        return {"now": now, "today": midnight, "yesterday": midnight - timedelta(days=1)}[text]
    if match := _RELATIVE.fullmatch(text):
        try:
            return now - int(match.group(1)) * _UNITS[match.group(2)]
        except OverflowError:
            raise ValueError(f"{value!r} reaches back before year 1") from None
    try:
        parsed = datetime.fromisoformat(value.strip())
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"{value!r} is not a time; use {TIME_HELP}") from None
    except OverflowError:  # 0001-01-01T00:00+01:00 has no UTC equivalent
        raise ValueError(f"{value!r} is out of range in UTC") from None


def as_utc(value: datetime | None) -> datetime | None:
    """*value* in UTC; one without an offset is taken as UTC."""
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{value.isoformat()} is out of range in UTC") from None


def parse_cost(value: str | float) -> float:
    """A cost bound: a finite number, 0 or more; ValueError else (nan would match nothing, silently)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{value!r} must be a finite number, 0 or more")
    return number


def parse_filters(values: Mapping[str, str | None], allowed: tuple[str, ...] | None = None) -> AuditFilters:
    """The filters of text *values* (a query string, CLI options, a form); empty values are unset.

    A name outside *allowed* (default: every filter) or a malformed value is a ValueError that names it."""
    allowed = tuple(FILTER_FIELDS) if allowed is None else allowed
    parsed: dict[str, object] = {}
    for name, raw in values.items():
        if name not in allowed:
            raise ValueError(f"unknown filter {name!r}; allowed: {', '.join(allowed)}")
        text = raw.strip() if isinstance(raw, str) else raw
        if text is None or text == "":
            continue
        try:
            if name in ("since", "until"):
                parsed[name] = parse_time(text) if isinstance(text, str) else as_utc(text)  # type: ignore[arg-type]
            elif name == "min_cost_usd":
                parsed[name] = parse_cost(text)
            else:
                parsed[name] = str(text)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return AuditFilters(**parsed)  # type: ignore[arg-type]
