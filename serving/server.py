"""``create_server``: the app ``inferline serve`` and the Ray ingress run, with the web console under ``/ui``.

:func:`serving.http.app.create_app` is the HTTP API alone; the console (:mod:`serving.console`) sits
above it and is added here, so that the HTTP layer never imports the console.
"""

from __future__ import annotations

from litestar import Litestar

from pipeline.protocols import EngineProvider
from serving.console import ConsolePlugin
from serving.http.app import create_app
from serving.runtime.workspace import Workspace


def create_server(workspace: Workspace, *, engines: EngineProvider | None = None,
                  freeze_heap: bool = False, listen_while_starting: bool = False) -> Litestar:
    """The app for *workspace* with its web console; the arguments are :func:`create_app`'s."""
    return create_app(workspace, engines=engines, freeze_heap=freeze_heap, listen_while_starting=listen_while_starting,
                      plugins=lambda state: [ConsolePlugin(state)])
