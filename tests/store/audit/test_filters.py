"""The audit log's one filter parser: times (ISO, naive as UTC, relative), costs, unknown names."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from store.audit import AuditStore
from store.audit.filters import FILTER_FIELDS, AuditFilters, parse_cost, parse_filters, parse_time

NOW = datetime(2026, 12, 5, 15, 30, 12, tzinfo=UTC)


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-12-05", datetime(2026, 12, 5, tzinfo=UTC)),                      # a date: midnight UTC
    ("2026-12-05T09:30", datetime(2026, 12, 5, 9, 30, tzinfo=UTC)),         # naive: UTC
    ("2026-12-05T09:30Z", datetime(2026, 12, 5, 9, 30, tzinfo=UTC)),
    ("2026-12-05T09:30+01:00", datetime(2026, 12, 5, 8, 30, tzinfo=UTC)),   # converted to UTC
    ("30m", NOW - timedelta(minutes=30)), ("24h", NOW - timedelta(hours=24)), ("7d", NOW - timedelta(days=7)),
    ("2w", NOW - timedelta(weeks=2)), (" 7D ", NOW - timedelta(days=7)),
    ("today", datetime(2026, 12, 5, tzinfo=UTC)), ("yesterday", datetime(2026, 12, 4, tzinfo=UTC)),
    ("now", NOW),
])
def test_times_are_utc_and_may_be_relative(text, expected):
    parsed = parse_time(text, now=NOW)
    assert parsed == expected and parsed.utcoffset() == timedelta(0)


@pytest.mark.parametrize("text", ["someday", "7", "7 days", "-7d", "d7", "", "2026-13-01", "9999999w",
                                  "0001-01-01T00:00+01:00"])
def test_garbage_times_are_refused_with_the_forms_allowed(text):
    with pytest.raises(ValueError) as error:
        parse_time(text, now=NOW)
    assert repr(text) in str(error.value)


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-0.5", "lots", ""])
def test_costs_are_finite_and_not_negative(value):
    with pytest.raises(ValueError):
        parse_cost(value)
    assert parse_cost("0.25") == 0.25 and parse_cost(0) == 0.0


def test_parse_filters_names_the_bad_or_unknown_filter():
    assert parse_filters({"since": "", "pipeline": " ", "key_id": None}) == AuditFilters()
    parsed = parse_filters({"since": "2026-12-05", "key_id": "k1", "min_cost_usd": "0.5"})
    assert parsed == AuditFilters(since=datetime(2026, 12, 5, tzinfo=UTC), key_id="k1", min_cost_usd=0.5)
    assert parsed.given() == {"since": "2026-12-05T00:00:00+00:00", "key_id": "k1", "min_cost_usd": 0.5}
    with pytest.raises(ValueError, match=r"^min_cost_usd: 'nan'"):
        parse_filters({"min_cost_usd": "nan"})
    with pytest.raises(ValueError, match=r"^until: 'tomorrow-ish'"):
        parse_filters({"until": "tomorrow-ish"})
    with pytest.raises(ValueError, match="unknown filter 'pipelin'"):
        parse_filters({"pipelin": "chat"})
    with pytest.raises(ValueError, match="unknown filter 'pipeline'; allowed: since, until"):
        parse_filters({"pipeline": "chat"}, ("since", "until"))
    # a naive datetime object (the CLI's, a library caller's) is taken as UTC too
    naive = parse_filters({"since": datetime(2026, 12, 5)})  # type: ignore[dict-item]
    assert naive.since == datetime(2026, 12, 5, tzinfo=UTC)
    assert set(FILTER_FIELDS) == set(AuditFilters.__dataclass_fields__) - {"kind", "subject_match"}  # both set in code


def test_the_store_refuses_a_non_finite_cost_whoever_builds_the_filters(engine, tmp_path):
    store = AuditStore(engine, spool_path=tmp_path / "spool")
    with pytest.raises(ValueError):
        store.query(AuditFilters(min_cost_usd=math.nan))
