"""What the handlers work with: :class:`Services`, made whole by the app's lifespan once everything is open.

Handlers never reach into the app's state for them: each declares what it uses as a dependency, by name, and
the routers provide it (``dependencies=``, serving/http/routers.py)::

    @get("/pipelines")
    async def list_pipelines(request: Request, executor: NamedDependency[Executor],
                             reloader: NamedDependency[PipelineReloader]) -> dict[str, Any]: ...

The names: ``services`` (all of them), ``executor``, ``auth``, ``deployments``, ``reloader``, ``audit`` and
``workspace``. Before the app has started, a route that needs one answers 503 (``starting``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.runner import Pipeline
from serving.backends.audit_sink import StoreSink
from serving.http.auth import Authenticator
from serving.http.mcp_server import McpSessions
from serving.http.problems import Problem
from serving.http.refusals import RefusalRecorder
from serving.http.served import Executor
from serving.runtime.deployments import Deployments
from serving.runtime.reloader import PipelineReloader
from serving.runtime.resources import Runtime
from store.audit import AuditStore
from store.responses import ResponseStore

#: The longest an audit read waits for journaled records to be chained (the database may be away).
AUDIT_READ_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class Services:
    """Everything the handlers use, open (see the module docstring)."""

    #: The pipelines over their resources: models, indexes, database, versions (``runtime.deployments``).
    runtime: Runtime
    #: Runs the requests: the served pipelines, the runner, the count in flight, the metrics.
    executor: Executor
    auth: Authenticator
    #: Follows the pipelines folder (hot reload); its failed edits are shown with the pipelines.
    reloader: PipelineReloader
    #: Records the refusals (401, 403, 413, 429), of every route, that no audit stage recorded.
    refusals: RefusalRecorder
    audit: AuditStore
    #: The pipelines' writer to ``audit``; reads wait on its ``flushed()`` for the records not yet chained.
    audit_sink: StoreSink
    #: The Responses API's stored responses (``store: true``).
    responses: ResponseStore
    #: The MCP server of ``/mcp`` (serving/http/mcp_routes.py) and its open sessions.
    mcp: McpSessions

    @property
    def deployments(self) -> Deployments:
        """Which versions serve: kept versions, pins, canary splits, shadows."""
        return self.runtime.deployments

    async def pinned(self, name: str, version: str) -> Pipeline:
        """Pipeline *name* at *version* (``name@version``); 404 naming what exists when there is none."""
        self.executor.get(name)  # 404 for a pipeline not served at all
        pipeline = await self.deployments.pinned(name, version)
        if pipeline is None:
            raise Problem(404, "Not found", f"pipeline {name!r} has no version {version!r} (its version: label, "
                          f"or six or more characters of its spec hash; GET /pipelines/{name}/versions lists them)",
                          "version_not_found")
        return pipeline

    async def audit_read_barrier(self) -> None:
        """Before an audit read: wait for the records whose requests have been answered but which are
        not chained yet, so that a reviewer sees them; a 503 when that takes over ``AUDIT_READ_WAIT_S``
        (the database is away), rather than an answer that silently lacks them."""
        settled = await self.refusals.settled(AUDIT_READ_WAIT_S)
        if not (settled and await self.audit_sink.flushed(AUDIT_READ_WAIT_S)):
            raise Problem(503, "Backend unavailable", "recent audit records are still being written to the "
                          "database; try again shortly", "backend_error", headers={"Retry-After": "5"})
