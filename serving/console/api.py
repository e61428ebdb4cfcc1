"""The console's JSON routes, called by its scripts; errors are problem details, as in the API.

``POST /ui/api/pipelines/{name}/run`` is the playground's door to ``POST /pipelines/{name}``: the
page cannot send the session's key as a bearer header (the key is in an HttpOnly cookie, out of the
script's reach, on purpose), so this route checks the CSRF header and hands the request to the API's
own handler with the cookie's key as its bearer. Auth, roles, limits, audit and the Server-Sent
Events are the API's, unchanged.

``GET /ui/api/metrics`` is what the metrics page polls (auditor, as ``GET /metrics``).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import Response

from serving.console.session import CSRF_HEADER, LoginRequired
from serving.console.state import Console
from serving.http import pipeline_routes
from serving.http.problems import Problem
from serving.http.refusals import RUNS_PIPELINE, attempt_of
from serving.http.schemas import PipelineRequest
from serving.http.state import AppState


@post("/pipelines/{name:str}/run", status_code=200, name="console-run", opt={RUNS_PIPELINE: "name"})
async def run(name: FromPath[str], data: JSONBody[PipelineRequest], request: Request) -> Response[Any]:
    """Run pipeline *name* for the signed-in user: the API's JSON answer or event stream."""
    console = Console.of(request)
    session = await console.session(request)
    console.sessions.check_csrf(request, session, request.headers.get(CSRF_HEADER))
    return await pipeline_routes.run_pipeline.fn(name=name, data=data, request=as_bearer(request, session.key),
                                                 services=console.services)


def as_bearer(request: Request, key: str) -> Request:
    """*request* as the API expects it: the key as ``Authorization: Bearer``, the console's cookies gone
    (nothing downstream needs them), and any key the request carried itself (``Authorization``,
    ``x-api-key``) too: it acts as the session, only. Without a key (auth off) none is sent."""
    headers = [(k, v) for k, v in request.scope["headers"]
               if k.lower() not in (b"authorization", b"x-api-key", b"cookie")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    attempt_of(request)  # made here, so that both requests share it: a refusal's record names the pipeline
    # A fresh connection state: Litestar caches parsed headers there.
    scope = {**request.scope, "headers": headers, "state": {}}
    return Request(scope, receive=request.receive, send=request.send)  # type: ignore[arg-type]


@get("/metrics", name="console-metrics-json")
async def metrics(request: Request) -> dict[str, Any]:
    """The charts' history: one point per sample, oldest first (see serving/console/metrics_sampler.py)."""
    console = Console.of(request)
    await console.session(request, ("auditor",), "read metrics")
    sampler = console.sampler
    return {"interval_s": sampler.interval_s, "window_s": sampler.window_s, "points": sampler.points(),
            "in_flight": console.services.executor.in_flight, "ready": console.state.ready}


def _login_required(request: Request, exc: LoginRequired) -> Response[Any]:
    problem = Problem(401, "Unauthorized", exc.reason or "sign in to the console first (/ui/login)",
                      "unauthorized")
    AppState.of(request).note_refusal(request, problem)  # as the API's own 401s are (serving/http/refusals.py)
    return pipeline_routes.problem_response(problem, request.url.path)


ROUTES = [run, metrics]
EXCEPTION_HANDLERS = {LoginRequired: _login_required}
