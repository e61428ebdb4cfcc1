"""What the HTTP handlers share: built by ``create_app``, owned by its lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field

from litestar import Request
from prometheus_client import CollectorRegistry

from serving.auth import Authenticator
from serving.execution import Executor
from serving.model_pool import ModelPool
from serving.wiring import Workspace
from store.audit import AuditStore


@dataclass(slots=True)
class AppState:
    workspace: Workspace
    executor: Executor
    auth: Authenticator
    pool: ModelPool
    registry: CollectorRegistry
    audit: AuditStore | None = None
    ready: bool = False
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def of(request: Request) -> AppState:
        return request.app.state.inferline
