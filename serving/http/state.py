"""What the HTTP handlers share: built by ``create_app``, owned by its lifespan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from litestar import Request
from prometheus_client import CollectorRegistry

from pipeline.protocols import EngineProvider
from pipeline.runner import Pipeline
from serving.backends.audit_sink import StoreSink
from serving.backends.model_pool import ModelPool
from serving.http.auth import Authenticator
from serving.http.problems import Problem
from serving.http.refusals import RefusalRecorder
from serving.http.served import Executor
from serving.runtime.reloader import PipelineReloader
from serving.runtime.workspace import Workspace
from store.audit import AuditStore
from store.responses import ResponseStore

#: The longest an audit read waits for journaled records to be chained (the database may be away).
AUDIT_READ_WAIT_S = 5.0


@dataclass(slots=True)
class AppState:
    workspace: Workspace
    executor: Executor
    auth: Authenticator
    pool: ModelPool
    registry: CollectorRegistry
    audit: AuditStore | None = None
    #: The pipelines' writer to ``audit``; reads wait on its ``flushed()`` for the records not yet chained.
    audit_sink: StoreSink | None = None
    #: Records the refusals (401, 403, 413, 429), of every route, that no audit stage recorded.
    refusals: RefusalRecorder | None = None
    #: Follows the pipelines folder (hot reload); its failed edits are shown with the pipelines.
    reloader: PipelineReloader | None = None
    #: The Responses API's stored responses (``store: true``).
    responses: ResponseStore | None = None
    ready: bool = False
    #: Why a start in the background failed ('' while it has not): /healthz then answers 503.
    start_error: str = ""
    #: Stops the HTTP server (``inferline serve`` sets it): called when a background start fails.
    stop_serving: Callable[[], None] | None = None
    notes: list[str] = field(default_factory=list)

    async def audit_read_barrier(self) -> None:
        """Before an audit read: wait for the records whose requests have been answered but which are
        not chained yet, so that a reviewer sees them; a 503 when that takes over ``AUDIT_READ_WAIT_S``
        (the database is away), rather than an answer that silently lacks them."""
        settled = self.refusals is None or await self.refusals.settled(AUDIT_READ_WAIT_S)
        if self.audit_sink is not None and not (settled and await self.audit_sink.flushed(AUDIT_READ_WAIT_S)):
            raise Problem(503, "Backend unavailable", "recent audit records are still being written to the "
                          "database; try again shortly", "backend_error", headers={"Retry-After": "5"})

    def split_choice(self, name: str, sticky: str) -> str | None:
        """The version (spec hash) a request of *name* goes to under a canary split; None without one."""
        return self.reloader.runtime.split_choice(name, sticky) if self.reloader is not None else None

    async def pinned(self, name: str, version: str) -> Pipeline:
        """Pipeline *name* at *version* (``name@version``); 404 naming what exists when there is none."""
        self.executor.get(name)  # 404 for a pipeline not served at all
        pipeline = await self.reloader.runtime.pinned(name, version) if self.reloader is not None else None
        if pipeline is None:
            raise Problem(404, "Not found", f"pipeline {name!r} has no version {version!r} (its version: label, "
                          f"or six or more characters of its spec hash; GET /pipelines/{name}/versions lists them)",
                          "version_not_found")
        return pipeline

    @property
    def engines(self) -> EngineProvider | None:
        """The models as the pipelines' stages reach them (the model pool, or the fakes a test passes)."""
        return self.reloader.runtime.resources.engines if self.reloader is not None else None

    @staticmethod
    def of(request: Request) -> AppState:
        return request.app.state.inferline
