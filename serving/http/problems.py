"""RFC 9457 problem details: one table from our errors to HTTP statuses.

Handlers raise :class:`Problem` (or let an ``InferlineError`` propagate);
the app's exception handlers turn either into an ``application/problem+json``
body. A client's mistake is always 4xx; only our own failures are 5xx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pipeline.errors import InferlineError, PolicyDenied, status_of

PROBLEM_TYPE = "https://inferline.dev/problems/"

#: Error kind (``InferlineError.kind``) -> HTTP status.
@dataclass
class Problem(Exception):
    """An error response, already decided."""

    status: int
    title: str
    detail: str = ""
    kind: str = "error"
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, instance: str = "") -> dict[str, Any]:
        body = {"type": PROBLEM_TYPE + self.kind, "title": self.title, "status": self.status,
                "detail": self.detail, **self.extra}
        if instance:
            body["instance"] = instance
        return body


def from_error(exc: BaseException) -> Problem:
    """The problem for an error raised while serving a request."""
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, InferlineError):
        status = status_of(exc.kind)
        retry_after = getattr(exc, "retry_after_s", None)  # Overloaded, RateLimited
        headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else {}
        title = _KIND_TITLES.get(exc.kind) or _TITLES.get(status, "Request failed")
        # A refusal names the policy and rule, never the content that triggered it.
        extra = {"policy": exc.policy, "rule": exc.rule, "category": exc.category} if isinstance(
            exc, PolicyDenied) else {}
        return Problem(status, title, str(exc), exc.kind, headers, extra)
    return Problem(500, "Internal error", "the server failed while handling the request", "internal_error")


def from_final(kind: str, message: str, error: BaseException | None) -> Problem:
    """The problem for a pipeline run that ended in an Error event."""
    if error is not None:
        problem = from_error(error)
        if problem.status != 500:
            return problem
    status = status_of(kind)
    return Problem(status, _KIND_TITLES.get(kind) or _TITLES.get(status, "Request failed"), message, kind)


_TITLES = {
    400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 413: "Request body too large",
    422: "Unprocessable request", 429: "Too many requests", 500: "Internal error", 503: "Backend unavailable",
    504: "Stage timed out",
}
#: Titles more precise than their status's.
_KIND_TITLES = {"deadline_exceeded": "Queue deadline passed"}


#: ``ctx.facts["limits"]`` entry -> header name part.
_LIMIT_HEADERS = {"requests": "X-RateLimit-{}-Requests", "tokens": "X-RateLimit-{}-Tokens",
                  "cost_usd": "X-Budget-{}-Usd"}


def limit_headers(limits: dict[str, dict[str, float]] | None) -> dict[str, str]:
    """``X-RateLimit-Limit/Remaining/Reset-Requests`` (and ``-Tokens``), ``X-Budget-*-Usd``: what the
    policy stage counted for this request. Reset is in whole seconds."""
    headers: dict[str, str] = {}
    for name, entry in (limits or {}).items():
        template = _LIMIT_HEADERS.get(name)
        if template is None:
            continue
        money = name == "cost_usd"
        headers[template.format("Limit")] = f"{entry['limit']:g}" if money else str(int(entry["limit"]))
        headers[template.format("Remaining")] = (f"{entry['remaining']:.6g}" if money
                                                 else str(int(entry["remaining"])))
        headers[template.format("Reset")] = str(max(0, int(entry["reset_s"] + 0.999)))
    return headers


def title_for(status: int) -> str:
    return _TITLES.get(status, "Error")


def checked(adapter: TypeAdapter[Any], value: Any, param: str, expected: str = "") -> Any:
    """*value* validated by *adapter*; a 400 naming *param* (and where in it) if it does not fit."""
    if value is None:
        return None
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        if expected:
            raise bad_request(f"{param}: expected {expected}, got {json.dumps(value)[:100]}", param) from None
        where = "; ".join(f"{param}{_path(e['loc'], value)}: {e['msg']}" for e in exc.errors())
        raise bad_request(where, param) from None


def _path(loc: tuple[Any, ...], value: Any) -> str:
    """``[0].function.name``: where in *value* the error is, without the tags that a tagged union puts in
    (``json_schema.json_schema``: the object's ``type``, then its field)."""
    parts, node, tag_skipped = [], value, False
    for part in loc:
        if isinstance(node, dict) and part == node.get("type") and part not in node and not tag_skipped:
            tag_skipped = True
            continue
        parts.append(f"[{part}]" if isinstance(part, int) else f".{part}")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
        tag_skipped = False
    return "".join(parts)


def bad_request(message: str, param: str) -> Problem:
    """A 400 naming the request's field *param*."""
    return Problem(400, "Bad request", message, "invalid_request", extra={"param": param})
