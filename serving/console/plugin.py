"""The Litestar plugin that mounts the web console under ``/ui``.

``serving.server.create_server`` adds ``ConsolePlugin(state)``; the plugin then

* wraps the runner of the app's requests (``AppState.runner_layers``) so that every request's trace lands in
  the console's ring;
* mounts the pages (``/ui/...``, errors as HTML pages), their JSON routes (``/ui/api/...``, errors as
  problem details) and the static files (``/ui/static``);
* adds a lifespan that samples the metrics registry every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Router
from litestar.config.app import AppConfig
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.plugins import InitPlugin
from litestar.response import Response
from litestar.static_files import create_static_files_router

from serving.console import api, audit_pages, pages
from serving.console.render import error_status, login_redirect
from serving.console.session import COOKIE_PATH, KEY_COOKIE, LoginRequired
from serving.console.state import SESSION_KEY, STATE_KEY, Console
from serving.console.trace_ring import RecordingRunner
from serving.http.ops_routes import WHILE_STARTING
from serving.http.problems import Problem
from serving.http.state import AppState

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


def page_errors(request: Request, exc: Exception) -> Response[Any]:
    """Errors of console pages: a login redirect, or a friendly HTML page with the status. A refusal (a
    role the page does not allow, a form's CSRF check) is audited as the API's are."""
    if isinstance(exc, LoginRequired):
        return login_redirect(request, exc.reason)
    status, title, detail, kind = error_status(exc)
    AppState.of(request).note_refusal(request, Problem(status, title, detail, kind))
    console = Console.of(request)
    # The session, when it was resolved before the error: the page keeps its nav and logout form.
    session = request.state.get(SESSION_KEY) if status != 401 else None
    return console.page(request, session, "error.html", status=status, status_code=status, title=title,
                        detail=detail, kind=kind)


async def early_session(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Resolve the page's session before anything else may fail (a query parameter that does not parse, a
    page that is not there), so that the error page shows who is signed in. Never refuses: the handler
    resolves the session it needs itself, and says what is wrong."""
    with contextlib.suppress(LoginRequired, Problem):
        connection.state[SESSION_KEY] = await Console.of(connection).sessions.session(connection, optional=True)


class ConsolePlugin(InitPlugin):
    """Mounts the web console on the app (see the module docstring)."""

    def __init__(self, state: AppState, **options: Any):
        self.console = Console(state, **options)
        state.key_cookie = (COOKIE_PATH, KEY_COOKIE)  # a refused console request names its session's key
        ring = self.console.ring
        state.runner_layers.append(lambda runner: RecordingRunner(runner, ring))  # type: ignore[arg-type,return-value]

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.state[STATE_KEY] = self.console
        app_config.route_handlers += [
            Router("/ui", route_handlers=[*pages.ROUTES, *audit_pages.ROUTES], guards=[early_session],
                   exception_handlers={Exception: page_errors}, include_in_schema=False),
            Router("/ui/api", route_handlers=api.ROUTES, exception_handlers=api.EXCEPTION_HANDLERS,
                   include_in_schema=False),
            create_static_files_router("/ui/static", directories=[STATIC_DIR], name="console-static",
                                       opt=WHILE_STARTING),
        ]
        app_config.lifespan = [*app_config.lifespan, self._lifespan]
        return app_config

    @asynccontextmanager
    async def _lifespan(self, app: Litestar) -> AsyncIterator[None]:
        task = asyncio.create_task(self.console.sampler.run())
        http = self.console.state.workspace.server.http
        logger.info("web console on http://%s:%d/ui", http.host, http.port)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
