"""The one place that opens and closes every resource the pipelines run over.

    runtime = Runtime(workspace, loaded, RuntimeOptions.server())
    async with runtime:
        final = await runtime.runner.run(runtime.pipelines["rag"], ctx)

The app's lifespan (``inferline serve``, the Ray ingress), ``inferline run`` and ``inferline eval``
all run their pipelines over a :class:`Runtime`. Constructing one builds the pipelines and the objects
that hold no connection (model pool, index registry, tracer, :class:`~serving.runtime.deployments.
Deployments`); ``async with`` opens the database, the audit store and sink, the counters and the
indexes, keeps the pipelines' versions when asked, and starts the models when asked. Everything opened
is closed in reverse order on an :class:`~contextlib.AsyncExitStack`, each close attempted even when an
earlier one raises. Which versions serve (pins, splits, shadows) is :class:`Deployments`' business;
which pipelines serve is :class:`~serving.runtime.served_pipelines.ServedPipelines`'.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from pipeline.loader import LoadedPipeline
from pipeline.protocols import EngineProvider, Resources
from pipeline.refs import find_refs
from pipeline.runner import Pipeline, Runner
from pipeline.tracing import make_tracer_provider
from serving.backends.audit_keys import checkpoint_signer, serving_signer
from serving.backends.audit_seal import audit_seal
from serving.backends.audit_sink import StoreSink, open_sink, open_store
from serving.backends.caches import StoreCaches
from serving.backends.embedders import EmbedderPool
from serving.backends.indexes import IndexRegistry
from serving.backends.model_pool import ModelPool
from serving.backends.rerankers import RerankerPool
from serving.backends.tool_hub import ToolHub
from serving.config.loader import catalog_of
from serving.config.server import LimitsSpec
from serving.runtime.calls import LocalPipelines, Requests
from serving.runtime.database import open_engine
from serving.runtime.deployments import Deployments
from serving.runtime.served_pipelines import ServedPipelines
from serving.runtime.workspace import Workspace
from store.audit import AuditStore
from store.counters import RedisCounters, SqlCounters
from store.pipeline_versions import ToolPins

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RuntimeOptions:
    """What a runtime opens beyond the minimum; :meth:`server` is what a serving process wants."""

    #: Replaces the model pool as the pipelines' engines (tests pass fakes).
    engines: EngineProvider | None = None
    #: Where the engines' metrics go (the app's ``/metrics`` registry); None: nowhere.
    metrics_registry: CollectorRegistry | None = None
    #: Start every local model on open, so that the process is ready when it says so.
    start_models: bool = False
    #: Write audit records through this process's journal (and first chain what stopped processes left).
    journal: bool = False
    #: Open every index of the config and reload each when it changes on disk; otherwise open only the
    #: indexes the pipelines read, once (loading the embedding model takes seconds).
    all_indexes: bool = False
    #: Keep each pipeline loaded as a version in the database (its YAML text, by spec hash).
    record_versions: bool = False

    @classmethod
    def server(cls, engines: EngineProvider | None = None,
               metrics_registry: CollectorRegistry | None = None) -> RuntimeOptions:
        return cls(engines, metrics_registry, start_models=True, journal=True, all_indexes=True,
                   record_versions=True)


class Runtime:
    """Pipelines over live resources: models, indexes, caches, database, audit sink, counters, tracer."""

    def __init__(self, workspace: Workspace, loaded: Sequence[LoadedPipeline],
                 options: RuntimeOptions = RuntimeOptions(), *,
                 requests: Callable[[Runtime], Requests] | None = None):
        server = workspace.server
        self.workspace = workspace
        self.options = options
        telemetry = server.telemetry
        self.tracer_provider = make_tracer_provider(telemetry.exporter, telemetry.endpoint, telemetry.service_name)
        capture = telemetry.capture_message_content or os.environ.get(
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").lower() == "true"
        self.runner = Runner(self.tracer_provider.get_tracer("inferline"), capture_content=capture)
        self.pool = ModelPool(server, workspace.root, options.metrics_registry)
        #: The pipelines' models: the pool, or what replaced it.
        self.engines: EngineProvider = options.engines or self.pool
        self.indexes = IndexRegistry(server, workspace.root)
        #: The sentence-embedding models of the ``embed`` stages, loaded on first use or by start_models.
        self.embedders = EmbedderPool(server, workspace.root)
        #: The agent steps' tools; their pins are kept with the pipeline versions once the database is open.
        self.tools = ToolHub(server, workspace.root, options.metrics_registry)
        self.resources = Resources(catalog_of(server), engines=self.engines, indexes=self.indexes,
                                   caches=StoreCaches(), embedders=self.embedders,
                                   rerankers=RerankerPool(server, workspace.root),
                                   tools=self.tools)
        #: The pipelines served, by name: the hot reload swaps versions in and out (serving/runtime/reloader.py).
        self.pipelines = ServedPipelines(Pipeline(item, self.resources) for item in loaded)
        #: The versions kept, pins, canary splits and shadows (kept in the database once open, when asked).
        self.deployments = Deployments(workspace, self.pipelines, self.resources)
        #: Runs one request: the runner, or what *requests* made of this runtime (the app's executor, which
        #: counts each request in its metrics).
        self.requests: Requests = requests(self) if requests is not None else self.runner
        #: How a ``score`` stage's judge or a ``pipeline`` step calls another pipeline.
        self.calls = self.resources.pipelines = LocalPipelines(self.pipelines, self.requests.run, self.runner.stream,
                                                               self.deployments.pinned)
        self.db: sa.Engine | None = None
        self.audit: AuditStore | None = None
        self.audit_sink: StoreSink | None = None
        self.counters: SqlCounters | RedisCounters | None = None
        self._stack: AsyncExitStack | None = None

    async def __aenter__(self) -> Runtime:
        if self._stack is not None:
            raise RuntimeError("this runtime is open already")
        self._stack = stack = AsyncExitStack()
        try:
            await self._open(stack)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close what was opened, newest first; every close runs, the first error is raised after."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def _open(self, stack: AsyncExitStack) -> None:
        server, root, options = self.workspace.server, self.workspace.root, self.options
        stack.callback(self.tracer_provider.shutdown)
        self.db = db = open_engine(self.workspace.database_url)
        stack.callback(db.dispose)
        self.tools.pins = ToolPins(db)
        if options.record_versions:
            await self.deployments.open(db)
        # A serving process signs with the config's key or, failing that, its own (made on first start); it
        # seals the newest records with a checkpoint every few seconds and delivers their digests.
        signer = await asyncio.to_thread(serving_signer, server, db.url) if options.journal \
            else checkpoint_signer(server)
        self.audit = open_store(server, root, db, signer)
        seal = audit_seal(server, root, self.audit, signer, options.metrics_registry) if options.journal else None
        if seal is not None:
            stack.push_async_callback(seal.aclose)  # after the sink's close: what it chained last is sealed too
        if options.journal:
            replayed = await asyncio.to_thread(self.audit.replay_spool)
            if replayed:
                logger.info("audit: replayed %d spooled record(s)", replayed)
            self.audit_sink = await asyncio.to_thread(open_sink, server, root, self.audit)
        else:
            self.audit_sink = StoreSink(self.audit)
        stack.push_async_callback(self.audit_sink.aclose)
        if seal is not None:
            await seal.start()
        self.resources.audit = self.audit_sink
        self.counters = await open_counters(server.limits, db)
        stack.push_async_callback(self.counters.close)
        self.resources.counters = self.counters
        if options.all_indexes:
            await asyncio.to_thread(self.indexes.refresh)
            watcher = asyncio.create_task(self.indexes.watch())
            stack.callback(watcher.cancel)
        elif used := self._indexes_read():
            await asyncio.to_thread(self.indexes.refresh, used)
        stack.push_async_callback(self.deployments.aclose)
        stack.push_async_callback(self._close_pipelines)
        for pipeline in self.pipelines.values():  # now that their tools' pins can be kept
            pipeline.start()
        stack.push_async_callback(self.pool.close)
        if isinstance(self.resources.tools, ToolHub):
            stack.push_async_callback(self.resources.tools.aclose)
        if options.start_models and options.engines is None:
            await self.pool.start_all()
        if options.start_models:
            await self.embedders.start(self._refs_read("embedding_model"))

    async def _close_pipelines(self) -> None:
        # Those served at close: a hot reload may have replaced the ones opened here (and closed those).
        for pipeline in reversed(list(self.pipelines.values())):
            try:
                await pipeline.aclose()
            except Exception:
                logger.exception("pipeline %s: closing failed", pipeline.name)

    def _indexes_read(self) -> set[str]:
        return self._refs_read("index")

    def _refs_read(self, kind: str) -> set[str]:
        """The resources of *kind* (``index``, ``embedding_model``) the pipelines name."""
        return {name for pipeline in self.pipelines.values() for plan in pipeline.loaded.plans
                for _, ref, name in find_refs(plan.config) if ref == kind}


async def open_counters(spec: LimitsSpec, db: sa.Engine) -> SqlCounters | RedisCounters:
    """The policy stage's counters: the database, or Redis (a Redis that is down is logged, not fatal:
    requests that need limits get 503 until it is back)."""
    if spec.backend == "database":
        return SqlCounters(db)
    counters = RedisCounters(spec.redis_url, spec.prefix)
    try:
        await counters.ping()
    except Exception as exc:
        logger.error("limits: Redis is unreachable (%s); requests with limits get 503 until it is back",
                     type(exc).__name__)
    return counters
