"""Refused calls in the audit log: 401, 403, 413 and 429 on every route, recorded by the server, within a bound.

A refusal that a pipeline's ``audit`` stage recorded (a policy's 403 or 429) is that stage's record. Every
other refusal, of any route the app serves, is recorded here, once, in the same log and hash chain: no key
or a bad one (401), a role the route or the pipeline does not allow (403), a body over
``http.max_body_bytes`` (413), a limit or a full queue in a pipeline without an audit stage (429). Which
routes are covered is not a list: every router's exception handler hands every answer here (the console's
handlers too), and the status decides. The record has status ``denied`` (or the run's own status), the
HTTP status, the reason's code as ``error_type``, and one ``policy`` entry from stage ``server`` with its
rule, category, message and route; the key's id and role when it verified, never the key, and no content.
It names a pipeline only where the refused request called one (its handler had resolved it, or the
route's ``opt`` names the path parameter of the pipeline it runs: :data:`RUNS_PIPELINE`); a refused
read of the audit log or a refused deploy names none.

A flood must not fill the database: each refusal takes a token from a bucket per client address and reason
and from one shared by all (``audit.refusals``); without one it is counted in
``inferline_audit_refusals_dropped_total{reason}`` and not recorded. The refusal's answer never waits for
its record: the record is written by a task of its own, which audit reads wait for (:meth:`settled`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from litestar import Request
from prometheus_client import CollectorRegistry, Counter

from pipeline.context import Principal, RequestContext
from pipeline.errors import Overloaded, PolicyDenied, RateLimited
from pipeline.runner import Pipeline
from pipeline.spec import is_pipeline_name
from serving.backends.audit_sink import StoreSink
from serving.config.audit import RefusalsSpec
from serving.http.auth import Authenticator, api_key
from serving.http.problems import Problem
from store.keys import public_id

logger = logging.getLogger(__name__)

#: The statuses recorded as refusals, whichever route answered them.
REFUSED_STATUSES = frozenset({401, 403, 413, 429})
#: A route handler's ``opt`` key: the path parameter that names the pipeline the route runs (``POST
#: /pipelines/{name}``), so that a refusal before its handler resolved the pipeline (a 413) names it.
RUNS_PIPELINE = "runs_pipeline"
#: At most this many client buckets are kept (the least recently used go first; a client forgotten
#: starts full again, and the shared bucket still bounds the total).
MAX_CLIENTS = 10_000
_SCOPE_KEY = "inferline.attempt"
#: ctx.status -> the record's status, as the audit stage writes it.
_STATUS = {"denied": "denied", "failed": "failed", "cancelled": "disconnected"}
#: Column widths of audit_records (store/audit/models.py) that a caller's own text could exceed.
_MAX_PIPELINE = 200
#: The longest route kept in a refusal's policy entry (a path is the caller's own text).
_MAX_ROUTE = 512


@dataclass(slots=True)
class Attempt:
    """What the handler learned of a pipeline call before it was refused (kept in the ASGI scope)."""

    pipeline: Pipeline | None = None
    principal: Principal | None = None
    ctx: RequestContext | None = None


def attempt_of(request: Request) -> Attempt:
    """The request's :class:`Attempt`, made on first use."""
    attempt = request.scope.get(_SCOPE_KEY)  # type: ignore[misc]
    if attempt is None:
        attempt = request.scope[_SCOPE_KEY] = Attempt()  # type: ignore[literal-required]
    return attempt


@dataclass(slots=True)
class Reason:
    """Why a request was refused: a short code, the rule and category of its ``policy`` entry."""

    code: str
    rule: str
    category: str


@dataclass(slots=True)
class TokenBucket:
    """Up to *capacity* tokens, refilled evenly at *capacity* a minute; starts full at time *at*."""

    capacity: float
    at: float
    tokens: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.capacity

    def take(self, now: float) -> bool:
        """Take a token at time *now* (seconds); whether there was one."""
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.at) * self.capacity / 60.0)
        self.at = max(self.at, now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class RefusalRecorder:
    """Writes an audit record for each refused request, within ``audit.refusals``' buckets."""

    def __init__(self, spec: RefusalsSpec, auth: Authenticator, pipelines: Mapping[str, Pipeline],
                 registry: CollectorRegistry, sink: StoreSink, key_cookie: tuple[str, str] | None = None):
        self.spec = spec
        self.auth = auth
        self.pipelines = pipelines
        self.clock = time.monotonic
        #: The server's audit sink, which the records go to.
        self.sink = sink
        #: (path prefix, cookie name): where a key comes as a cookie rather than a header (the web console's
        #: session, which its plugin names), so that a refusal there names the key that was tried.
        self.key_cookie = key_cookie
        self.dropped = Counter("inferline_audit_refusals_dropped", "Refused requests (401, 403, 413, 429) not "
                               "recorded in the audit log because audit.refusals' bound was reached, by reason.",
                               ["reason"], registry=registry)
        self._shared = TokenBucket(spec.per_minute, self.clock())
        self._clients: dict[tuple[str, str], TokenBucket] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def note(self, request: Request, problem: Problem) -> None:
        """Record *problem*, the answer to *request*, if it is a refusal (:data:`REFUSED_STATUSES`). Never
        raises, never waits: the record is written by a task of its own."""
        try:
            self._note(request, problem)
        except Exception:  # the refusal's own answer matters more than its record
            logger.exception("audit: the refusal of %s %s could not be recorded", request.method, request.url.path)

    def _note(self, request: Request, problem: Problem) -> None:
        if problem.status not in REFUSED_STATUSES:
            return
        attempt: Attempt = request.scope.get(_SCOPE_KEY) or Attempt()  # type: ignore[misc,assignment]
        ctx = attempt.ctx
        if ctx is not None and ctx.facts.get("audited"):
            return  # the pipeline's audit stage recorded it
        token = self._key(request)
        reason = _reason(problem, token, ctx)
        client = request.client.host if request.client else ""
        if not self._admit(client, reason.code):
            self.dropped.labels(reason.code).inc()
            return
        named = _named_pipeline(request) if attempt.pipeline is None else ""
        if named:  # refused before the handler resolved it (413): the pipeline the path names
            attempt.pipeline = self.pipelines.get(named)
        record = _record(request, problem, reason, attempt, client, named)
        claimed = public_id(token) if reason.code == "invalid_key" and token else None
        if claimed is not None:  # a well-formed key's public part: which key was tried, not who holds it
            record["policy"][0]["claimed_key_id"] = claimed
        # A 413 is refused before the handler checks the key, and a route's own role check (403) keeps no
        # attempt: who sent it is looked up off the answer's path.
        principal = attempt.principal or (ctx.principal if ctx is not None else None)
        identify = token if principal is None and problem.status in (403, 413) and self.auth.enabled else None
        task = asyncio.get_running_loop().create_task(self._write(self.sink, record, identify))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _key(self, request: Request) -> str | None:
        """The key *request* presented: its headers', else the console's session cookie where it has one."""
        headers = request.headers
        token = api_key(headers.get("authorization", ""), headers.get("x-api-key", ""))
        if token is None and self.key_cookie is not None and request.url.path.startswith(self.key_cookie[0]):
            token = request.cookies.get(self.key_cookie[1], "").strip() or None
        return token

    def _admit(self, client: str, code: str) -> bool:
        now = self.clock()
        key = (client, code)
        bucket = self._clients.pop(key, None)  # re-inserted last: the dict's order is the use order
        if bucket is None:
            bucket = TokenBucket(self.spec.per_client_per_minute, now)
            while len(self._clients) >= MAX_CLIENTS:
                del self._clients[next(iter(self._clients))]
        self._clients[key] = bucket
        # The client's bucket first: a flood from one address spends its own tokens, not everyone's.
        return bucket.take(now) and self._shared.take(now)

    async def _write(self, sink: StoreSink, record: dict[str, Any], token: str | None) -> None:
        try:
            if token is not None:
                try:
                    principal: Principal | None = await self.auth.verify(token)
                except Problem:
                    principal = None
                if principal is not None:
                    record["key_id"], record["role"] = principal.key_id, principal.role
            await sink.write(record)
        except Exception as exc:
            logger.error("audit: a refusal (%s, HTTP %s) could not be recorded: %s: %s", record["error_type"],
                         record["http_status"], type(exc).__name__, exc)

    async def settled(self, timeout: float | None = None) -> bool:
        """Wait until the refusals noted so far are handed to the sink (or *timeout*); whether they are."""
        pending = set(self._tasks)
        if not pending:
            return True
        _, late = await asyncio.wait(pending, timeout=timeout)
        return not late


def _named_pipeline(request: Request) -> str:
    """The pipeline the route runs, by its path (:data:`RUNS_PIPELINE`); '' for a route that runs none by
    its path, or a name no pipeline may have (kept out of the log: a NUL, a path, 5,000 characters)."""
    handler = request.scope.get("route_handler")
    param = handler.opt.get(RUNS_PIPELINE) if handler is not None else None
    name = str(request.path_params.get(param, "")) if param else ""
    return name if is_pipeline_name(name) else ""


def _reason(problem: Problem, token: str | None, ctx: RequestContext | None) -> Reason:
    error = ctx.error if ctx is not None else None
    if problem.status == 401:
        return Reason("missing_key", "auth.missing_key", "auth") if token is None else Reason(
            "invalid_key", "auth.invalid_key", "auth")
    if problem.status == 413:
        return Reason("body_too_large", "limits.max_body_bytes", "limits")
    if isinstance(error, RateLimited):
        code = "rate_limit" if error.rule == "limits.requests_per_minute" else "budget"
        return Reason(code, error.rule, "limits")
    if isinstance(error, Overloaded):
        return Reason("overloaded", "engine.max_waiting", "limits")
    if isinstance(error, PolicyDenied):
        return Reason("policy_denied", error.rule, error.category)
    if problem.status == 403:  # a role the route or the pipeline does not allow; the console's CSRF check
        return Reason("role_not_allowed", "auth.role", "auth") if problem.kind == "forbidden" else Reason(
            problem.kind, f"auth.{problem.kind}", "auth")
    return Reason(problem.kind, problem.kind, "limits")


def _record(request: Request, problem: Problem, reason: Reason, attempt: Attempt, client: str,
            named: str) -> dict[str, Any]:
    ctx, pipeline = attempt.ctx, attempt.pipeline
    now = datetime.now(UTC)
    received = ctx.received_at if ctx is not None else now
    principal = attempt.principal or (ctx.principal if ctx is not None else None)
    name = pipeline.spec.name if pipeline is not None else named
    return {
        "request_id": ctx.request_id if ctx is not None else uuid.uuid4().hex,
        "trace_id": (ctx.trace_id or None) if ctx is not None else None,
        "received_at": received, "completed_at": now, "duration_ms": (now - received).total_seconds() * 1e3,
        "key_id": principal.key_id if principal else None, "role": principal.role if principal else None,
        "client_addr": client[:64] or None,
        # A pipeline that is not served (a 413 before the 404) is recorded by the name asked for; a request
        # that called no pipeline (an audit read, a deploy) names none.
        "pipeline": name[:_MAX_PIPELINE],
        "pipeline_version": pipeline.spec.version if pipeline is not None else "",
        "spec_sha256": pipeline.loaded.sha256 if pipeline is not None else "",
        "model": (ctx.model or None) if ctx is not None else None,
        "policy": [{"stage": "server", "where": "request", "rule": reason.rule, "category": reason.category,
                    "action": "block", "score": 1.0, "span": [], "message": _printable(problem.detail),
                    "route": _printable(request.url.path)[:_MAX_ROUTE]}],
        "policy_action": "block", "policy_categories": reason.category,
        "status": _STATUS.get(ctx.status, "denied") if ctx is not None else "denied",
        "http_status": problem.status, "error_type": reason.code,
        # Nothing of what a refused caller sent is kept, not even its hash.
        "content_mode": "hash", "input_content": "", "output_content": "",
    }


def _printable(text: str) -> str:
    """*text* with its control characters escaped (a NUL is refused by PostgreSQL's text and JSON types)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
