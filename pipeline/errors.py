"""The one error tree of Inferline.

Everything we raise on purpose derives from :class:`InferlineError`. The HTTP
layer maps these types to problem-details responses; stages never raise HTTP
errors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


class InferlineError(Exception):
    """Base of every error Inferline raises on purpose."""

    #: A short machine-readable kind, used in events, audit records and problem types.
    kind = "inferline_error"


@dataclass(frozen=True, slots=True)
class SpecIssue:
    """One located problem in a YAML file."""

    file: str
    line: int
    col: int
    loc: str
    message: str

    def __str__(self) -> str:
        where = f"{self.loc}: " if self.loc else ""
        return f"{self.file}:{self.line}:{self.col}: {where}{self.message}"


class SpecError(InferlineError):
    """A YAML file failed to load; carries every problem found in it."""

    kind = "spec_error"

    def __init__(self, issues: list[SpecIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))


class ExpressionError(InferlineError):
    """A ``when:`` expression is malformed or uses something not allowed."""

    kind = "expression_error"

    def __init__(self, message: str, col: int = 0):
        self.col = col
        super().__init__(message)


class TemplateError(InferlineError):
    """A prompt template is malformed or names a field that does not exist."""

    kind = "template_error"


class PluginError(InferlineError):
    """A plugin or entry point could not be imported or registered."""

    kind = "plugin_error"


class StageError(InferlineError):
    """A stage failed while running a request."""

    kind = "stage_error"

    def __init__(self, stage_id: str, message: str):
        self.stage_id = stage_id
        super().__init__(message)


class StageTimeout(StageError):
    """A stage ran past its ``timeout_s``."""

    kind = "stage_timeout"


class InvalidOutput(InferlineError):
    """A step's output does not match what it must be (its JSON Schema, regular expression or choices): a
    ``retry:`` with ``on: [invalid_output]`` runs it again."""

    kind = "invalid_output"


class EmptyOutput(InferlineError):
    """A step gave no text where text was needed."""

    kind = "empty_output"


class PolicyDenied(InferlineError):
    """A policy decided the request must not proceed. Not a failure of the system."""

    kind = "policy_denied"

    def __init__(self, message: str, *, rule: str = "", category: str = "", policy: str = ""):
        self.rule = rule
        self.category = category
        #: The id of the policy stage that refused (problem details name it, never the content).
        self.policy = policy
        super().__init__(message)


class RateLimited(PolicyDenied):
    """A rate limit or budget is used up for now; retry after ``retry_after_s``."""

    kind = "rate_limited"

    def __init__(self, message: str, *, rule: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message, rule=rule, category="limits")


class InvalidInput(InferlineError):
    """The request itself is unacceptable (too long, bad parameters); the client must change it."""

    kind = "invalid_input"


class BackendError(InferlineError):
    """A model backend failed or is unavailable while serving the request."""

    kind = "backend_error"


class Overloaded(InferlineError):
    """A backend refused new work because its queue is full; retry later."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class DeadlineExceeded(InferlineError):
    """The request was still queued for its model at its deadline (``queue_timeout_ms``): dropped unstarted."""

    kind = "deadline_exceeded"


# The HTTP status each error kind maps to; the audit log records it for failed requests too.
STATUS_BY_KIND = {
    "invalid_input": 400,
    "policy_denied": 403,
    "rate_limited": 429,
    "overloaded": 429,
    "stage_timeout": 504,
    "backend_error": 503,
    "deadline_exceeded": 503,
    "no_engine": 503,
    # A model's answer that is not what its step must give (its schema, or no text): the model's, not the
    # caller's, as an upstream server's bad answer is.
    "invalid_output": 502,
    "empty_output": 502,
}


def status_of(kind: str) -> int:
    """The HTTP status for an error *kind* (500 for one not listed)."""
    return STATUS_BY_KIND.get(kind, 500)
