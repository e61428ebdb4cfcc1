"""The console's pages: pipelines and their playground, traces, live metrics, login and logout.

Roles are the API's: the pipelines pages as ``GET /pipelines`` (caller, auditor), the playground as
the pipeline's ``access.roles``, metrics as ``GET /metrics`` (auditor). A trace is shown to the key
that made the request and to reviewers; reviewers also reach older requests through the audit log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import yaml
from litestar import Request, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Response

from serving.console.audit_pages import find_record
from serving.console.graph_view import draw
from serving.console.render import SECURITY_HEADERS
from serving.console.session import CSRF_FIELD, safe_next
from serving.console.state import Console
from serving.console.trace_view import from_entry, from_record
from serving.http.pipeline_routes import describe
from serving.http.problems import Problem

logger = logging.getLogger(__name__)

_PIPELINE_ROLES = ("caller", "auditor")


def _percentiles(prefix: str) -> list[dict[str, Any]]:
    return [{"field": f"{prefix}_{q}_ms", "label": q, "scale": 1} for q in ("p50", "p95", "p99")]


#: The metrics page's charts: the y axis's unit, and each line's point field (metrics_sampler.point), its
#: name in the legend and the factor to the unit. A line's place in its list picks its colour and dash.
CHARTS: list[dict[str, Any]] = [
    {"id": "rps", "title": "Requests per second", "unit": "req/s",
     "series": [{"field": "rps", "label": "finished requests", "scale": 1}]},
    {"id": "ttft", "title": "Time to first token", "unit": "ms", "series": _percentiles("ttft")},
    {"id": "itl", "title": "Inter-token latency", "unit": "ms", "series": _percentiles("itl")},
    {"id": "queue_depth", "title": "Requests waiting and running", "unit": "requests",
     "series": [{"field": "queue_depth", "label": "waiting", "scale": 1},
                {"field": "running", "label": "running", "scale": 1}]},
    {"id": "kv_cache_usage", "title": "KV-cache usage", "unit": "%",
     "series": [{"field": "kv_cache_usage", "label": "fullest engine", "scale": 100}]},
    {"id": "prefix_cache_hit_rate", "title": "Prefix-cache hit rate", "unit": "%",
     "series": [{"field": "prefix_cache_hit_rate", "label": "prompt tokens found", "scale": 100}]},
    {"id": "cost_per_request_usd", "title": "Cost per request", "unit": "USD",
     "series": [{"field": "cost_per_request_usd", "label": "mean per finished request", "scale": 1}]},
]


@get(["/", "/pipelines"], name="console-pipelines")
async def pipelines_page(request: Request) -> Response[str]:
    """Every served pipeline with its stage chain."""
    console = Console.of(request)
    session = await console.session(request, _PIPELINE_ROLES, "list pipelines")
    served = [describe(p) for p in console.services.executor.pipelines.values()]
    errors = sorted(console.services.reloader.errors.values(), key=lambda e: e.file)
    return console.page(request, session, "pipelines.html", pipelines=sorted(served, key=lambda p: p["name"]),
                        ready=console.state.ready, reload_errors=errors)


@get("/pipelines/{name:str}", name="console-pipeline")
async def pipeline_page(request: Request, name: FromPath[str]) -> Response[str]:
    """One pipeline: its graph, its stages with their config, and the playground."""
    console = Console.of(request)
    session = await console.session(request, _PIPELINE_ROLES, "describe pipelines")
    pipeline = console.services.executor.get(name)
    described = describe(pipeline)
    for stage in described["stages"]:
        stage["config_yaml"] = yaml.safe_dump(stage["with"], sort_keys=False, allow_unicode=True).strip() \
            if stage["with"] else ""
    roles = pipeline.spec.access.roles
    reload_error = console.services.reloader.error_for(name)
    return console.page(request, session, "pipeline.html", pipeline=described, graph=draw(pipeline.loaded),
                        may_call=session.can(*roles), call_roles=roles, reload_error=reload_error)


@get("/traces", name="console-traces")
async def traces_page(request: Request, id: FromQuery[str | None] = None) -> Response[Any]:
    """The recent requests the console saw (the caller's own, or everyone's for reviewers)."""
    console = Console.of(request)
    session = await console.session(request)
    if id and id.strip():
        return Redirect(f"/ui/traces/{quote(id.strip(), safe='')}", status_code=303, headers=SECURITY_HEADERS)
    key_id = session.principal.key_id if session.principal else None
    entries = console.ring.recent(100, key_id=key_id, everyone=session.can("auditor"))
    return console.page(request, session, "traces.html", entries=entries, capacity=console.ring.capacity)


@get("/traces/{ident:str}", name="console-trace")
async def trace_page(request: Request, ident: FromPath[str]) -> Response[str]:
    """One request's waterfall, by trace id or request id (or audit record id, for reviewers)."""
    console = Console.of(request)
    session = await console.session(request)
    entry = console.ring.get(ident)
    own = session.principal is not None and entry is not None and entry.key_id == session.principal.key_id
    if entry is not None and (own or session.can("auditor")):
        return console.page(request, session, "trace.html", trace=from_entry(entry))
    if session.can("auditor"):
        record = await find_record(console, request, session, ident)
        if record is not None:
            return console.page(request, session, "trace.html", trace=from_record(record))
    raise Problem(404, "Not found", f"no trace {ident!r} among the last {console.ring.capacity} requests"
                  + ("" if session.can("auditor") else " you made") + " (reviewers also find older ones "
                  "in the audit log)", "trace_not_found")


@get("/metrics", name="console-metrics")
async def metrics_page(request: Request) -> Response[str]:
    """Live charts, drawn by static/metrics.js from /ui/api/metrics."""
    console = Console.of(request)
    session = await console.session(request, ("auditor",), "read metrics")
    return console.page(request, session, "metrics.html", interval_s=console.sampler.interval_s,
                        window_s=console.sampler.window_s, charts=CHARTS)


@get("/login", name="console-login")
async def login_page(request: Request, next: FromQuery[str | None] = None,
                     reason: FromQuery[str | None] = None) -> Response[str]:
    """The login form (with auth off: a note that none is needed)."""
    console = Console.of(request)
    session = await console.session(request, optional=True)
    return console.page(request, session, "login.html", next=safe_next(next), reason=(reason or "")[:200],
                        error="")


@post("/login", name="console-login-post", status_code=303)
async def login(request: Request) -> Response[Any]:
    """Check the CSRF token and the key; hold the key in the session cookie."""
    console = Console.of(request)
    session = await console.session(request, optional=True)
    form = await request.form()
    console.sessions.check_csrf(request, session, _field(form, CSRF_FIELD))
    target = safe_next(_field(form, "next"))
    if not console.services.auth.enabled:
        return Redirect(target, status_code=303, headers=SECURITY_HEADERS)
    key = (_field(form, "api_key") or "").strip()
    principal = await console.sessions.verify(key) if key else None
    if principal is None:
        # A short pause makes guessing slower; keys are 256-bit random, so this is politeness, not defence.
        await asyncio.sleep(0.2)
        return console.page(request, session, "login.html", status=401, next=target, reason="",
                            error="That key is unknown or revoked.")
    logger.info("console: key %s (%s) signed in", principal.key_id, principal.role)
    return Redirect(target, status_code=303, headers=SECURITY_HEADERS,
                    cookies=console.sessions.login_cookies(request, key))


@post("/logout", name="console-logout", status_code=303)
async def logout(request: Request) -> Response[Any]:
    """Forget the key (CSRF-checked, so another site cannot sign a user out)."""
    console = Console.of(request)
    session = await console.session(request, optional=True)
    form = await request.form()
    console.sessions.check_csrf(request, session, _field(form, CSRF_FIELD))
    if session.principal is not None:
        logger.info("console: key %s signed out", session.principal.key_id)
    return Redirect("/ui/login", status_code=303, headers=SECURITY_HEADERS,
                    cookies=console.sessions.logout_cookies(request))


@get("/{rest:path}", name="console-not-found")
async def not_found(request: Request, rest: FromPath[str]) -> Response[str]:
    """Any other path under /ui: the console's 404 page rather than the API's problem document."""
    raise Problem(404, "Not found", "there is no console page here", "not_found")


def _field(form: Any, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


ROUTES = [pipelines_page, pipeline_page, traces_page, trace_page, metrics_page, login_page, login, logout,
          not_found]
