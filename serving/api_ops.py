"""Operations: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.response import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.problems import Problem
from serving.state import AppState


@get("/healthz", summary="Liveness: the process answers", tags=["operations"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: models loaded, ready for traffic", tags=["operations"])
async def readyz(request: Request) -> Response[dict[str, Any]]:
    state = AppState.of(request)
    engines = {name: engine.stats() for name, engine in state.pool.engines().items()}
    body = {"status": "ready" if state.ready else "starting",
            "models": {name: {k: stats[k] for k in ("running", "waiting", "kv_usage")}
                       for name, stats in engines.items()},
            "pipelines": sorted(state.executor.pipelines)}
    if not state.ready:
        raise Problem(503, "Not ready", "models are still loading", "not_ready", {"Retry-After": "1"}, body)
    return Response(body)


@get("/metrics", summary="Prometheus metrics (engine, pipelines, stages)", tags=["operations"],
     media_type=CONTENT_TYPE_LATEST)
async def metrics(request: Request) -> Response[bytes]:
    state = AppState.of(request)
    await state.auth.authorize(request, ("auditor",), "read metrics")
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
