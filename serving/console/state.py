"""What the console's handlers share (:class:`Console`): the app's state and services, sessions, traces, metrics,
templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request
from litestar.response import Response

from serving.backends.audit_keys import anchor_folder
from serving.console.metrics_sampler import MetricsSampler
from serving.console.render import html, make_environment
from serving.console.session import Session, SessionManager
from serving.console.trace_ring import TraceRing
from serving.http.services import Services
from serving.http.state import AppState

#: Where the app's state keeps the console.
STATE_KEY = "inferline_console"
#: Where a request's state keeps its session, for the error page should the request fail later.
SESSION_KEY = "inferline_console_session"


class Console:
    """What the console's handlers share: the app's state, sessions, traces, metrics, templates."""

    def __init__(self, state: AppState, *, ring_size: int = 500, sample_interval_s: float = 2.0):
        self.state = state
        self.sessions = SessionManager(lambda: state.services.auth)
        self.ring = TraceRing(ring_size)
        self.sampler = MetricsSampler(state.registry, interval_s=sample_interval_s)
        self.templates = make_environment()

    @property
    def services(self) -> Services:
        """The app's services (a 503 before it has started)."""
        return self.state.services

    @staticmethod
    def of(request: Request) -> Console:
        return request.app.state[STATE_KEY]

    async def session(self, request: Request, roles: tuple[str, ...] = (), what: str = "", *,
                      optional: bool = False) -> Session:
        """The request's session; 403 unless it holds one of *roles* (when given). Without a valid key
        (auth on): LoginRequired, or with *optional* a session without a principal."""
        session = request.state.get(SESSION_KEY)  # resolved by the router's guard (plugin.early_session)
        if session is None or (session.principal is None and session.auth_enabled and not optional):
            session = await self.sessions.session(request, optional=optional)
        request.state[SESSION_KEY] = session  # for the error page, should this request fail later
        if roles:
            self.sessions.require(session, roles, what)
        return session

    def anchors_dir(self) -> Path | None:
        """The folder the server delivers audit digests to (``audit.anchors.dir``, or its own beside the database)."""
        workspace = self.state.workspace
        return anchor_folder(workspace.server, workspace.root, workspace.database_url)

    def page(self, request: Request, session: Session | None, template: str, status: int = 200,
             **values: Any) -> Response[str]:
        """Render *template* with what every page shows: who is signed in, the nav, the CSRF token."""
        body = self.templates.get_template(template).render(
            session=session, auth_enabled=self.state.workspace.server.auth.enabled, path=request.url.path,
            csrf_token=self.sessions.token(session) if session is not None else "",
            can_review=session is not None and session.can("auditor"), **values)
        cookies = self.sessions.cookies(request, session) if session is not None else []
        return html(body, status, cookies)
