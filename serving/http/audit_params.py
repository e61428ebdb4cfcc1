"""The audit routes' query parameters, declared once: the filters of ``/audit/records``, ``/summary``,
``/export`` and the console's audit pages (:func:`audit_filters`), the time range of ``/verify``
(:func:`time_range`), the access log's filters (:func:`access_filters`), and a guard that refuses a
query parameter the route does not take (:func:`refuse_unknown_query`), so a typo is a 400, not a
silently wider answer.

The values are parsed by ``store.audit``'s filter parsers, as the CLI's are.
"""

from __future__ import annotations

from typing import Annotated

from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.params import Parameter

from serving.http.problems import Problem
from store.audit import (
    FILTER_FIELDS,
    RANGE_FIELDS,
    TIME_HELP,
    AccessFilters,
    AuditFilters,
    parse_access_filters,
    parse_filters,
)

# A parameter's type, its documentation: all are text, parsed by the store's one parser.
_Time = Annotated[str | None, Parameter(required=False, description=f"ISO 8601 or relative: {TIME_HELP}")]
_Cost = Annotated[str | None, Parameter(required=False, description=FILTER_FIELDS["min_cost_usd"])]
_Text = Annotated[str | None, Parameter(required=False)]
_Subject = Annotated[str | None, Parameter(required=False, description=FILTER_FIELDS["subject"])]


def _bad(exc: ValueError) -> Problem:
    return Problem(400, "Bad request", str(exc), "invalid_query")


async def _audit_filters(since: _Time = None, until: _Time = None, pipeline: _Text = None, spec_sha256: _Text = None,
                         key_id: _Text = None, model: _Text = None, policy_action: _Text = None,
                         policy_category: _Text = None, status: _Text = None, finish_reason: _Text = None,
                         min_cost_usd: _Cost = None, text: _Text = None, subject: _Subject = None) -> AuditFilters:
    values = {"since": since, "until": until, "pipeline": pipeline, "spec_sha256": spec_sha256, "key_id": key_id,
              "model": model, "policy_action": policy_action, "policy_category": policy_category, "status": status,
              "finish_reason": finish_reason, "min_cost_usd": min_cost_usd, "text": text, "subject": subject}
    try:
        return parse_filters(values)
    except ValueError as exc:
        raise _bad(exc) from None


async def _time_range(since: _Time = None, until: _Time = None) -> AuditFilters:
    try:
        return parse_filters({"since": since, "until": until}, RANGE_FIELDS)
    except ValueError as exc:
        raise _bad(exc) from None


async def _access_filters(since: _Time = None, until: _Time = None, key_id: _Text = None,
                          action: _Text = None) -> AccessFilters:
    try:
        return parse_access_filters({"since": since, "until": until, "key_id": key_id, "action": action})
    except ValueError as exc:
        raise _bad(exc) from None


#: ``filters``: every filter of the audit log (FILTER_FIELDS), parsed once for every route that takes them.
audit_filters = Provide(_audit_filters)
#: ``filters``: since and until only (chain verification).
time_range = Provide(_time_range)
#: ``filters``: the access log's filters (ACCESS_FIELDS).
access_filters = Provide(_access_filters)

_KNOWN = "_known_query_params"  # the guard's cache, in the handler's own opt


def refuse_unknown_query(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Guard: a 400 naming the first query parameter that *handler* does not declare (itself or through
    its dependencies)."""
    names = handler.opt.get(_KNOWN)
    if names is None:
        model = handler.create_kwargs_model({name: None for name in connection.path_params})  # type: ignore[misc]
        declared = {param.field_alias for param in model.expected_query_params}
        names = handler.opt[_KNOWN] = frozenset(declared)
    unknown = [name for name in connection.query_params if name not in names]
    if unknown:
        raise Problem(400, "Bad request", f"unknown query parameter {unknown[0]!r}; this route takes: "
                                          f"{', '.join(sorted(names)) or 'none'}", "invalid_query",
                      extra={"unknown_parameters": unknown})
