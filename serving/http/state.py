"""The app's state: what ``create_app`` builds it with, how far it has started, and once started its services."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from litestar import Request
from prometheus_client import CollectorRegistry

from pipeline.loader import LoadedPipeline
from pipeline.runner import Runner
from serving.http.problems import Problem
from serving.http.services import Services
from serving.runtime.workspace import Workspace

#: ``Retry-After`` of the 503 ``starting`` answers while models load.
STARTING_RETRY_AFTER_S = 5


@dataclass(slots=True)
class AppState:
    """Built whole by ``create_app`` (settings, the pipelines it starts with, the metrics registry, what plugins
    add); the lifespan then :meth:`start`\\ s it with the services it opened, and :meth:`stop`\\ s it at shutdown.
    Handlers reach the services through dependency injection (serving/http/services.py), only once started:
    until then every route but those marked ``while_starting`` answers 503 (serving/http/routers.py)."""

    workspace: Workspace
    #: The pipelines the app starts with, checked as a set by the factory (serving/runtime/pipeline_set.py).
    loaded: tuple[LoadedPipeline, ...]
    registry: CollectorRegistry
    #: What plugins wrap the runner of the app's requests in (the console's trace ring), innermost first.
    runner_layers: list[Callable[[Runner], Runner]] = field(default_factory=list)
    #: (path prefix, cookie name): where a key comes as a cookie rather than a header (the console's session),
    #: so that a refusal there names the key that was tried.
    key_cookie: tuple[str, str] | None = None
    #: Why a start in the background failed ('' while it has not): /healthz then answers 503.
    start_error: str = ""
    #: Stops the HTTP server (``inferline serve`` sets it): called when a background start fails.
    stop_serving: Callable[[], None] | None = None
    _services: Services | None = None

    @property
    def ready(self) -> bool:
        """Started, and not yet shutting down."""
        return self._services is not None

    @property
    def services(self) -> Services:
        """The services, once started; the 503 a request gets before (``starting``, or ``start_failed``)."""
        if self._services is None:
            raise self.not_ready()
        return self._services

    def start(self, services: Services) -> None:
        """Serve with *services* (everything the lifespan opened)."""
        self._services = services

    def stop(self) -> None:
        """Shutting down: new requests get 503; those in flight keep the services they hold."""
        self._services = None

    def not_ready(self) -> Problem:
        """What a request that needs the services gets before they are there."""
        if self.start_error:
            return Problem(503, "Not ready", "the server failed to start; its log says why", "start_failed")
        return Problem(503, "Starting", "the server is starting: models are loading; retry shortly", "starting",
                       {"Retry-After": str(STARTING_RETRY_AFTER_S)})

    def note_refusal(self, request: Request, problem: Problem) -> None:
        """Hand *problem*, the answer to *request*, to the refusal recorder (serving/http/refusals.py), once started."""
        if self._services is not None:
            self._services.refusals.note(request, problem)

    @staticmethod
    def of(request: Request) -> AppState:
        return request.app.state.inferline
