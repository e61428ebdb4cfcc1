"""Which documents a metadata filter keeps: evaluated before the search ranks anything.

A filter is plain data (the ``retrieve`` stage parses the YAML language, checks it against the index's
declared fields and renders its templates; this module only evaluates)::

    {"and": [FILTER, ...]}   {"or": [FILTER, ...]}
    {"field": "tenant", "op": "eq", "value": "acme"}
    {"field": "product", "op": "in", "value": ["plus", "business"]}
    {"field": "updated", "op": "range", "value": {"gte": "2025-01-01", "lt": "2026-01-01"}}
    {"field": "path", "op": "glob", "value": ["billing*", "refunds*"]}

Values are typed already: numbers are numbers, dates ``YYYY-MM-DD`` strings (which order as dates). A
document without the field, or with a value of another type, does not match; a list field matches when
any of its items does.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

_RANGE = {"gt": lambda a, b: a > b, "gte": lambda a, b: a >= b, "lt": lambda a, b: a < b,
          "lte": lambda a, b: a <= b}


def matches(where: Mapping[str, Any], values: Mapping[str, Any]) -> bool:
    """Whether a document with metadata *values* passes filter *where*."""
    if "and" in where:
        return all(matches(part, values) for part in where["and"])
    if "or" in where:
        return any(matches(part, values) for part in where["or"])
    field, op, wanted = where["field"], where["op"], where["value"]
    if field not in values or values[field] is None:
        return False
    value = values[field]
    items = value if isinstance(value, list) else [value]
    return any(_match_one(item, op, wanted) for item in items)


def _match_one(item: Any, op: str, wanted: Any) -> bool:
    if op == "eq":
        return _same(item, wanted)
    if op == "in":
        return any(_same(item, w) for w in wanted)
    if op == "glob":
        return isinstance(item, str) and any(fnmatchcase(item, pattern) for pattern in wanted)
    if op == "range":
        return all(_comparable(item, bound) and _RANGE[name](item, bound) for name, bound in wanted.items())
    raise ValueError(f"unknown filter operator {op!r}")


def _same(a: Any, b: Any) -> bool:
    return _comparable(a, b) and a == b


def _comparable(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    return (isinstance(a, numbers) and isinstance(b, numbers)) or (isinstance(a, str) and isinstance(b, str))


def globs(filters: Mapping[str, str | list[str]]) -> dict[str, Any]:
    """The older glob filters (``{"path": "billing*"}``: a pattern, or a list of them, per field) as a filter."""
    parts = [{"field": key, "op": "glob", "value": [wanted] if isinstance(wanted, str) else list(wanted)}
             for key, wanted in filters.items()]
    return {"and": parts}


__all__ = ["globs", "matches"]
