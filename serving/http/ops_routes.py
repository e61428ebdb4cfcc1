"""Operations: liveness, readiness, the version and Prometheus metrics.

``/health`` and ``/version`` answer as vLLM's server does (and SGLang's, TGI's and llama-server's
``/health``), so that the tools written against those (guidellm's health check, load balancers) work
unchanged: ``/health`` is 200 once ready, 503 while models load.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.di import NamedDependency
from litestar.response import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline import __version__
from pipeline.protocols import ModelOccupancy
from serving.backends.model_pool import ModelPool
from serving.engine.metrics import with_vllm_names
from serving.http.auth import Authenticator
from serving.http.openapi import Public, problems
from serving.http.problems import Problem
from serving.http.state import AppState
from serving.runtime.workspace import Workspace

#: Routes that answer while the server starts (app.py's ``_while_starting``).
WHILE_STARTING = {"while_starting": True}


@get("/healthz", summary="Liveness: the process answers (503 only once a start has failed)", tags=["operations"],
     responses=problems(503), operation_class=Public, opt=WHILE_STARTING)
async def healthz(request: Request) -> dict[str, str]:
    error = AppState.of(request).start_error
    if error:
        raise Problem(503, "Start failed", "the server failed to start; its log says why", "start_failed")
    return {"status": "ok"}


@get("/readyz", summary="Readiness: models loaded, ready for traffic", tags=["operations"],
     responses=problems(503), operation_class=Public, opt=WHILE_STARTING)
async def readyz(request: Request) -> Response[dict[str, Any]]:
    state = AppState.of(request)
    if not state.ready:  # the models configured, none started yet; the pipelines it starts with
        body = {"status": "starting", "models": _models(state.workspace, None),
                "pipelines": sorted(item.spec.name for item in state.loaded)}
        raise Problem(503, "Not ready", _not_ready(state), "not_ready", {"Retry-After": "1"}, body)
    services = state.services
    return Response({"status": "ready", "models": _models(state.workspace, services.runtime.pool),
                     "pipelines": sorted(services.executor.pipelines)})


@get("/health", summary="Health, as vLLM answers it: 200 once ready, 503 while starting", tags=["operations"],
     responses=problems(503), operation_class=Public, opt=WHILE_STARTING)
async def health(request: Request) -> Response[dict[str, Any]]:
    state = AppState.of(request)
    if not state.ready:
        raise Problem(503, "Not ready", _not_ready(state), "not_ready", {"Retry-After": "1"})
    return Response({})


@get("/version", summary="The server's version", tags=["operations"], operation_class=Public, opt=WHILE_STARTING)
async def version() -> dict[str, str]:
    return {"version": __version__}


@get("/metrics", summary="Prometheus metrics (engine, pipelines, stages)", tags=["operations"],
     media_type=CONTENT_TYPE_LATEST, responses=problems(401, 403, 503))
async def metrics(request: Request, auth: NamedDependency[Authenticator],
                  workspace: NamedDependency[Workspace]) -> Response[bytes]:
    await auth.authorize(request, ("auditor",), "read metrics")
    exposition = generate_latest(AppState.of(request).registry)
    if workspace.server.telemetry.vllm_metric_names:
        exposition = with_vllm_names(exposition.decode()).encode()
    return Response(exposition, media_type=CONTENT_TYPE_LATEST)


def _not_ready(state: AppState) -> str:
    return "the server failed to start; its log says why" if state.start_error else "models are still loading"


def _models(workspace: Workspace, pool: ModelPool | None) -> dict[str, dict[str, Any]]:
    """Each configured model by its own name: a local one's replicas summed (KV usage: the fullest
    replica's), a remote one's requests in flight; all idle before the *pool* is open."""
    engines = {name: engine.stats() for name, engine in pool.engines().items()} if pool is not None else {}
    models: dict[str, dict[str, Any]] = {}
    for name, spec in workspace.server.models.items():
        load = pool.occupancy(name) if pool is not None else ModelOccupancy()
        entry: dict[str, Any] = {"backend": spec.backend, "running": load.running, "waiting": load.waiting}
        if spec.backend == "local":
            replicas = [stats for key, stats in engines.items() if key == name or key.startswith(f"{name}#")]
            entry |= {"replicas": len(replicas), "kv_usage": max((r["kv_usage"] for r in replicas), default=0.0),
                      "running": sum(r["running"] for r in replicas), "waiting": sum(r["waiting"] for r in replicas)}
        models[name] = entry
    return models


ROUTES = [healthz, readyz, health, version, metrics]
