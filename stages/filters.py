"""The ``retrieve`` stage's ``filters:``: a small typed language over the index's document metadata.

YAML::

    filters:
      tenant: "{{ tenant }}"              # equality; a template is rendered from the request
      product: [plus, business]           # any of them (the same as {in: [plus, business]})
      version: {gte: 4, lt: 5}            # a range: gt, gte, lt, lte on a number or date field
      updated: {gte: 2025-01-01}
      tags: billing                       # a list field matches when one of its items does
      path: "billing*"                    # doc_id, path and title: glob patterns (or {glob: ...} on any string)
      or:                                 # and / or over filters (the keys of one mapping are all required)
        - {audience: admins}
        - {audience: everyone}

Fields are the index's declared ``metadata:`` (``inferline.yaml``, each ``string``, ``number``, ``date`` or
``list``) and the built-in ``doc_id``, ``path`` and ``title``. :func:`parse` checks a filter against them at
load: an unknown field, an operator its type does not have or a value of the wrong type is a located error.
A template's value is checked when the request renders it (a bad one is the request's error, 4xx).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from pipeline.context import FIELDS
from pipeline.diagnostics import suggest
from pipeline.errors import InvalidInput, TemplateError
from pipeline.template import Template, compile_template

#: Every document has these (the index's own), whatever it declares.
BUILTIN_FIELDS = {"doc_id": "string", "path": "string", "title": "string"}
RANGE_OPS = ("gt", "gte", "lt", "lte")
OPS = ("eq", "in", "glob", *RANGE_OPS)
Loc = tuple[str | int, ...]


class FilterError(Exception):
    """A filter that does not fit the index's fields: where in ``filters:`` and why."""

    def __init__(self, loc: Loc, message: str):
        super().__init__(message)
        self.loc = loc
        self.message = message


@dataclass(frozen=True, slots=True)
class Value:
    """A typed value, or a template rendered and typed per request."""

    kind: str
    value: Any = None
    template: Template | None = None
    #: Where it is in ``filters:``.
    loc: Loc = ()

    def render(self, values: Mapping[str, Any], where: str) -> Any:
        if self.template is None:
            return self.value
        text = self.template.render(values).strip()
        try:
            return typed(text, self.kind)
        except ValueError as exc:
            raise InvalidInput(f"filters.{where}: {exc} (from the template {self.template.source!r})") from None


@dataclass(frozen=True, slots=True)
class Condition:
    field: str
    op: str  # eq | in | glob | range
    value: Value | tuple[Value, ...] | tuple[tuple[str, Value], ...]

    def render(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if self.op == "range":
            rendered: Any = {name: v.render(values, f"{self.field}.{name}")
                             for name, v in self.value}  # type: ignore[misc,union-attr]
        elif isinstance(self.value, tuple):
            rendered = [v.render(values, self.field) for v in self.value]  # type: ignore[union-attr]
        else:
            rendered = self.value.render(values, self.field)
        return {"field": self.field, "op": self.op, "value": rendered}


@dataclass(frozen=True, slots=True)
class Group:
    op: str  # and | or
    parts: tuple[Group | Condition, ...]

    def render(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {self.op: [part.render(values) for part in self.parts]}


def parse(raw: Mapping[str, Any], fields: Mapping[str, str], loc: Loc = ()) -> Group:
    """*raw* (the YAML mapping) as a filter over *fields* (name -> type, built-ins included); raises
    :class:`FilterError` at the first problem."""
    if not isinstance(raw, Mapping):
        raise FilterError(loc, "expected a mapping of fields (or and/or) to values")
    parts: list[Group | Condition] = []
    for key, value in raw.items():
        if key in ("and", "or"):
            if not isinstance(value, list) or not value:
                raise FilterError((*loc, key), f"{key}: expected a non-empty list of filters")
            parts.append(Group(key, tuple(parse(item, fields, (*loc, key, n)) for n, item in enumerate(value))))
        else:
            parts += _field(str(key), value, fields, (*loc, key))
    return Group("and", tuple(parts))


def template_sources(raw: Any, loc: Loc = ()) -> dict[Loc, Template]:
    """The templates in a raw ``filters:`` value by place, whatever its fields' types (for the loader's check of
    the step outputs they read; a template that does not compile is :func:`parse`'s error to report)."""
    if isinstance(raw, Mapping):
        return {k: t for key, value in raw.items() for k, t in template_sources(value, (*loc, key)).items()}
    if isinstance(raw, list):
        return {k: t for n, value in enumerate(raw) for k, t in template_sources(value, (*loc, n)).items()}
    if isinstance(raw, str) and ("{{" in raw or "{%" in raw):
        try:
            return {loc: compile_template(raw)}
        except TemplateError:
            return {}
    return {}


def _field(name: str, value: Any, fields: Mapping[str, str], loc: Loc) -> list[Condition]:
    kind = fields.get(name)
    if kind is None:
        declared = ", ".join(sorted(fields))
        raise FilterError(loc, f"unknown field {name!r}{suggest(name, list(fields))} (fields: {declared}; declare "
                               "others under the index's metadata: in inferline.yaml)")
    if not isinstance(value, Mapping):
        if name in BUILTIN_FIELDS:  # doc_id, path, title: glob patterns, as before there was a language
            return [Condition(name, "glob", tuple(_value(v, "string", loc) for v in _listed(value)))]
        if isinstance(value, list):
            return [Condition(name, "in", _values(value, kind, loc))]
        return [Condition(name, "eq", _value(value, _item_kind(kind), loc))]
    unknown = [op for op in value if op not in OPS]
    if unknown:
        raise FilterError((*loc, unknown[0]), f"unknown operator {unknown[0]!r}{suggest(str(unknown[0]), OPS)} "
                                              f"(one of {', '.join(OPS)})")
    conditions = []
    if "eq" in value:
        conditions.append(Condition(name, "eq", _value(value["eq"], _item_kind(kind), (*loc, "eq"))))
    if "in" in value:
        if not isinstance(value["in"], list) or not value["in"]:
            raise FilterError((*loc, "in"), "in: expected a non-empty list of values")
        conditions.append(Condition(name, "in", _values(value["in"], kind, (*loc, "in"))))
    if "glob" in value:
        if kind not in ("string", "list"):
            raise FilterError((*loc, "glob"), f"glob needs a string or list field; {name!r} is a {kind}")
        conditions.append(Condition(name, "glob", tuple(_value(v, "string", (*loc, "glob"))
                                                        for v in _listed(value["glob"]))))
    bounds = [op for op in RANGE_OPS if op in value]
    if bounds:
        if kind not in ("number", "date"):
            raise FilterError((*loc, bounds[0]), f"{bounds[0]}: ranges need a number or date field; {name!r} is "
                                                 f"a {kind}")
        conditions.append(Condition(name, "range", tuple((op, _value(value[op], kind, (*loc, op))) for op in bounds)))
    if not conditions:
        raise FilterError(loc, f"{name}: expected a value, a list of values or an operator ({', '.join(OPS)})")
    return conditions


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _item_kind(kind: str) -> str:
    return "string" if kind == "list" else kind


def _values(items: list[Any], kind: str, loc: Loc) -> tuple[Value, ...]:
    return tuple(_value(item, _item_kind(kind), (*loc, n)) for n, item in enumerate(items))


def _value(raw: Any, kind: str, loc: Loc) -> Value:
    if isinstance(raw, str) and ("{{" in raw or "{%" in raw):
        try:
            template = compile_template(raw)
        except TemplateError as exc:
            raise FilterError(loc, str(exc)) from None
        unknown = sorted(template.names - FIELDS.keys() - {"steps"})
        if unknown:
            raise FilterError(loc, f"template names unknown field {unknown[0]!r}")
        return Value(kind, template=template, loc=loc)
    try:
        return Value(kind, typed(raw, kind), loc=loc)
    except ValueError as exc:
        raise FilterError(loc, str(exc)) from None


def typed(raw: Any, kind: str) -> Any:
    """*raw* as a value of a field of type *kind* (dates as ``YYYY-MM-DD``); raises ValueError."""
    if isinstance(raw, bool) or raw is None or isinstance(raw, list | dict):
        raise ValueError(f"expected a {kind} value, got {raw!r}")
    if kind == "number":
        if isinstance(raw, int | float):
            return raw
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
    if kind == "date":
        if isinstance(raw, datetime):
            return raw.date().isoformat()
        if isinstance(raw, date):
            return raw.isoformat()
        try:
            return datetime.fromisoformat(str(raw)).date().isoformat()
        except ValueError:
            raise ValueError(f"expected a date (YYYY-MM-DD), got {raw!r}") from None
    if isinstance(raw, int | float):
        return str(raw)
    if isinstance(raw, date):
        return raw.isoformat()
    return str(raw)
