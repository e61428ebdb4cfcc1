"""HTML for the console: the Jinja environment, its page responses and its error pages.

Templates are autoescaped (they show stored audit content and pipeline
configs, which are data, never markup), and every page carries a strict
Content-Security-Policy: scripts and styles come only from ``/ui/static``, so
a string that slipped past escaping still could not run.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, select_autoescape
from litestar import Request
from litestar.datastructures import Cookie
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.response import Redirect, Response

from pipeline.errors import InferlineError
from serving.http.problems import Problem, from_error, title_for

logger = logging.getLogger(__name__)

SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; object-src 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: under no-referrer Chromium sends "Origin: null" with the console's own
    # form posts, and the CSRF check refuses a null origin.
    "Referrer-Policy": "same-origin",
    # Pages show audit records and who is signed in: never from a shared cache, never from history.
    "Cache-Control": "no-store",
}


def _ms(value: Any) -> str:
    if value is None:
        return "–"
    value = float(value)
    return f"{value:.1f} ms" if value < 10_000 else f"{value / 1e3:.2f} s"


def _usd(value: Any) -> str:
    if value is None:
        return "–"
    return f"${float(value):.6f}"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def make_environment() -> Environment:
    """The console's template environment (serving/console/templates, shipped as package data)."""
    # Plain (lenient) Undefined: a record written by an older version may lack a field, and a page
    # shows it empty rather than failing.
    env = Environment(loader=PackageLoader("serving.console", "templates"),
                      autoescape=select_autoescape(["html"], default_for_string=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ms=_ms, usd=_usd, pretty=_pretty, pct=lambda v: f"{float(v):.3f}")
    env.globals["urlquote"] = lambda value: quote(str(value), safe="")
    return env


def report_file(report: dict[str, Any]) -> str:
    """The audit report (store/audit/report.py) as one self-contained HTML page: inline style and SVG
    charts, nothing fetched from anywhere."""
    return make_environment().get_template("report_file.html").render(report=report)


def html(body: str, status: int = 200, cookies: list[Cookie] | None = None,
         headers: dict[str, str] | None = None) -> Response[str]:
    """A page response with the console's security headers."""
    return Response(body, status_code=status, media_type="text/html",
                    headers={**SECURITY_HEADERS, **(headers or {})}, cookies=cookies or [])


def login_redirect(request: Request, reason: str = "") -> Redirect:
    """303 to the login page, coming back here afterwards (GET pages only; a form post returns home)."""
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.method != "GET":
        target = "/ui"
    query = f"next={quote(target, safe='')}" + (f"&reason={quote(reason, safe='')}" if reason else "")
    return Redirect(f"/ui/login?{query}", status_code=303, headers=SECURITY_HEADERS)


def error_status(exc: Exception) -> tuple[int, str, str, str]:
    """(status, title, detail, kind) of *exc* for an error page; never the internals of a 500."""
    if isinstance(exc, (Problem, InferlineError)):
        problem = from_error(exc)
        return problem.status, problem.title, problem.detail, problem.kind
    if isinstance(exc, NotFoundException):
        return 404, "Not found", "there is no console page here", "not_found"
    if isinstance(exc, ValidationException):
        return 400, "Bad request", _validation_detail(exc), "invalid_query"
    if isinstance(exc, HTTPException):
        return exc.status_code, title_for(exc.status_code), str(exc.detail), "http_error"
    logger.exception("console: unhandled error", exc_info=exc)
    return 500, "Internal error", "the console failed while making this page; the server log has the details", \
        "internal_error"


def _validation_detail(exc: ValidationException) -> str:
    errors = exc.extra if isinstance(exc.extra, list) else []
    parts = [f"{e.get('key') or 'input'}: {e.get('message')}" for e in errors if isinstance(e, dict)]
    return "; ".join(parts) or str(exc.detail)
