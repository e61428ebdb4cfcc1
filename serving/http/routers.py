"""The app's three APIs as routers, each with the errors of its own clients, and the dependencies they provide.

=============  ============================================================  ======================================
router         routes                                                        errors
=============  ============================================================  ======================================
Inferline      ``/pipelines...`` (runs, versions), ``/audit/...``, ops,      RFC 9457 problem details
               ``/mcp`` (its HTTP errors; MCP's own are JSON-RPC's)
OpenAI         ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,  OpenAI's ``{"error": {...}}``
               ``/v1/responses...``, ``/v1/embeddings``, ``/tokenize``,
               ``/detokenize``
Anthropic      ``/v1/messages``, ``/v1/messages/count_tokens``                Anthropic's ``{"type": "error", ...}``
=============  ============================================================  ======================================

Every router's handler turns what was raised into a :class:`Problem` (:func:`problem_of`), hands it to the
refusal recorder (a 401, 403, 413 or 429 of any route is audited) and answers it in the router's shape. A
request no route takes (404, 405) is the app's, and answered as problem details.

Each router provides the handlers' collaborators by name (:data:`DEPENDENCIES`; serving/http/services.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Request, Router
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException, ValidationException
from litestar.response import Response

from pipeline.errors import InferlineError
from serving.http import (
    anthropic_routes,
    audit_routes,
    deploy_routes,
    embeddings_routes,
    mcp_routes,
    openai_common,
    openai_routes,
    openapi,
    ops_routes,
    pipeline_routes,
    responses_routes,
    tokenize_routes,
)
from serving.http.auth import Authenticator
from serving.http.problems import Problem, from_error, title_for
from serving.http.served import Executor
from serving.http.services import Services
from serving.http.state import AppState
from serving.runtime.deployments import Deployments
from serving.runtime.reloader import PipelineReloader
from serving.runtime.workspace import Workspace
from store.audit import AuditStore

logger = logging.getLogger(__name__)


def _services(request: Request) -> Services:
    return AppState.of(request).services  # a 503 until the app has started


def _workspace(request: Request) -> Workspace:
    return AppState.of(request).workspace


def _executor(services: NamedDependency[Services]) -> Executor:
    return services.executor


def _auth(services: NamedDependency[Services]) -> Authenticator:
    return services.auth


def _deployments(services: NamedDependency[Services]) -> Deployments:
    return services.deployments


def _reloader(services: NamedDependency[Services]) -> PipelineReloader:
    return services.reloader


def _audit(services: NamedDependency[Services]) -> AuditStore:
    return services.audit


#: What a handler may name as a parameter (``NamedDependency[T]``) to be given it.
DEPENDENCIES = {name: Provide(provider, sync_to_thread=False) for name, provider in (
    ("services", _services), ("workspace", _workspace), ("executor", _executor), ("auth", _auth),
    ("deployments", _deployments), ("reloader", _reloader), ("audit", _audit))}


def routers() -> list[Router]:
    """The Inferline, OpenAI and Anthropic routers (see the module docstring)."""
    inferline = [*pipeline_routes.ROUTES, *deploy_routes.ROUTES, *audit_routes.ROUTES, *ops_routes.ROUTES,
                 *mcp_routes.ROUTES, openapi.viewer_asset]
    openai = [*openai_routes.ROUTES, *responses_routes.ROUTES, *embeddings_routes.ROUTES, *tokenize_routes.ROUTES]
    return [Router("/", route_handlers=handlers, dependencies=DEPENDENCIES, exception_handlers={Exception: handler})
            for handlers, handler in ((inferline, problem_errors), (openai, answering(openai_common.error_response)),
                                      (anthropic_routes.ROUTES, answering(anthropic_routes.error_response)))]


def answering(shape: Callable[[Problem], Response[Any]]) -> Callable[[Request, Exception], Response[Any]]:
    """An exception handler that answers in *shape* (an API's error body), once the refusal is noted."""

    def handle(request: Request, exc: Exception) -> Response[Any]:
        problem = problem_of(exc)
        AppState.of(request).note_refusal(request, problem)  # audited off the answer's path
        return shape(problem)

    return handle


def problem_errors(request: Request, exc: Exception) -> Response[Any]:
    """Problem details (the Inferline API's errors, and a request no route takes)."""
    problem = problem_of(exc)
    AppState.of(request).note_refusal(request, problem)
    return pipeline_routes.problem_response(problem, request.url.path)


async def while_starting(request: Request) -> None:
    """Until the app is ready only the routes marked ``opt={"while_starting": True}`` (liveness,
    readiness, the version, the OpenAPI document, static files) answer; the others get 503 ``starting``."""
    state = AppState.of(request)
    if state.ready or request.route_handler.opt.get("while_starting") or \
            request.url.path.startswith(request.app.openapi_config.path):  # type: ignore[union-attr]
        return
    raise state.not_ready()


def problem_of(exc: Exception) -> Problem:
    """What *exc* means to the caller."""
    if isinstance(exc, (Problem, InferlineError)):
        return from_error(exc)
    if isinstance(exc, ValidationException):
        return _validation(exc)
    if isinstance(exc, RecursionError) and "deserializ" in str(exc):
        # msgspec refuses JSON nested past Python's recursion limit while decoding the body.
        return Problem(400, "Bad request", "the body is not valid JSON: it is nested too deeply", "malformed_json")
    if isinstance(exc, HTTPException):
        status = exc.status_code
        return Problem(status, title_for(status), str(exc.detail), title_for(status).lower().replace(" ", "_"),
                       dict(exc.headers or {}))
    logger.exception("unhandled error", exc_info=exc)
    return from_error(exc)


def _validation(exc: ValidationException) -> Problem:
    # Litestar raises ValidationException both for bodies that are not JSON
    # (400) and for JSON that does not fit the schema (422).
    errors = exc.extra if isinstance(exc.extra, list) else []
    if not errors or "decod" in str(exc.detail).lower():
        return Problem(400, "Bad request", f"the body is not valid JSON: {exc.detail}", "malformed_json")
    details = "; ".join(f"{e.get('key') or 'body'}: {e.get('message')}" for e in errors if isinstance(e, dict))
    return Problem(422, "Unprocessable request", details or str(exc.detail), "invalid_body", extra={"errors": errors})
