"""RFC 9457 problem details: one table from our errors to HTTP statuses.

Handlers raise :class:`Problem` (or let an ``InferlineError`` propagate);
the app's exception handlers turn either into an ``application/problem+json``
body. A client's mistake is always 4xx; only our own failures are 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import InferlineError, Overloaded

PROBLEM_TYPE = "https://inferline.dev/problems/"

#: Error kind (``InferlineError.kind``) -> HTTP status.
STATUS_BY_KIND = {
    "invalid_input": 400,
    "policy_denied": 403,
    "overloaded": 429,
    "stage_timeout": 504,
    "backend_error": 503,
    "no_engine": 503,
}


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


def status_of(kind: str) -> int:
    return STATUS_BY_KIND.get(kind, 500)


def from_error(exc: BaseException) -> Problem:
    """The problem for an error raised while serving a request."""
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, InferlineError):
        status = status_of(exc.kind)
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if isinstance(exc, Overloaded) else {}
        title = _TITLES.get(status, "Request failed")
        return Problem(status, title, str(exc), exc.kind, headers)
    return Problem(500, "Internal error", "the server failed while handling the request", "internal_error")


def from_final(kind: str, message: str, error: BaseException | None) -> Problem:
    """The problem for a pipeline run that ended in an Error event."""
    if error is not None:
        problem = from_error(error)
        if problem.status != 500:
            return problem
    status = status_of(kind)
    return Problem(status, _TITLES.get(status, "Request failed"), message, kind)


_TITLES = {
    400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 413: "Request body too large",
    422: "Unprocessable request", 429: "Too many requests", 500: "Internal error", 503: "Backend unavailable",
    504: "Stage timed out",
}


def title_for(status: int) -> str:
    return _TITLES.get(status, "Error")
