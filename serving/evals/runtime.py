"""Pipelines run in-process, over the real resources, as ``inferline run`` runs one.

    async with open_runtime(workspace, [loaded, judge]) as runtime:
        final = await runtime.runner.run(runtime.pipelines["rag"], ctx)

Opens the config's model pool (engines start on first use), database (audit records and
counters), the indexes the pipelines read, and response caches; a pipeline's ``score``
stage and the evaluator's judges reach the others through ``runtime.calls``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import sqlalchemy as sa

from pipeline.loader import LoadedPipeline, catalog_of
from pipeline.protocols import EngineProvider, Resources
from pipeline.refs import find_refs
from pipeline.runner import Pipeline, Runner
from pipeline.tracing import make_tracer_provider
from serving.evals.calls import LocalPipelines
from serving.wiring import Workspace


@dataclass(slots=True)
class Runtime:
    runner: Runner
    pipelines: dict[str, Pipeline]
    calls: LocalPipelines
    db: sa.Engine
    #: The pipelines' models (the pool, or what replaced it): ``inferline run`` starts them before its request.
    engines: EngineProvider


@asynccontextmanager
async def open_runtime(workspace: Workspace, loaded: Sequence[LoadedPipeline], *,
                       engines: EngineProvider | None = None) -> AsyncIterator[Runtime]:
    """*loaded* pipelines over live resources; *engines* replaces the model pool (tests pass fakes)."""
    from serving.app import open_counters
    from serving.audit_sink import StoreSink, open_store
    from serving.caches import StoreCaches
    from serving.indexes import IndexRegistry
    from serving.model_pool import ModelPool  # imports torch: only for commands that run models
    from store.db import create_schema, make_engine

    telemetry = workspace.server.telemetry
    provider = make_tracer_provider(telemetry.exporter, telemetry.endpoint, telemetry.service_name)
    runner = Runner(provider.get_tracer("inferline"))
    pool = ModelPool(workspace.server, workspace.root)
    db = make_engine(workspace.database_url)
    pipelines: dict[str, Pipeline] = {}
    counters = None
    sink = None
    try:
        create_schema(db)
        sink = StoreSink(open_store(workspace, db))
        counters = await open_counters(workspace.server.limits, db)
        indexes = IndexRegistry(workspace)
        used = {name for item in loaded for plan in item.plans for _, kind, name in find_refs(plan.config)
                if kind == "index"}
        if used:  # only the indexes these pipelines read: loading the embedding model takes seconds
            await asyncio.to_thread(indexes.refresh, used)
        engines = engines or pool
        resources = Resources(catalog_of(workspace.server), engines=engines, audit=sink, counters=counters,
                              indexes=indexes, caches=StoreCaches())
        pipelines = {item.spec.name: Pipeline(item, resources) for item in loaded}
        resources.pipelines = calls = LocalPipelines(pipelines, runner.run)
        yield Runtime(runner, pipelines, calls, db, engines)
    finally:
        await pool.close()
        for pipeline in pipelines.values():
            await pipeline.aclose()
        if sink is not None:
            await sink.aclose()
        if counters is not None:
            await counters.close()
        provider.shutdown()
        db.dispose()
