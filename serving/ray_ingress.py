"""The HTTP app as a Ray Serve application's ingress (``inferline deploy``, ``serve deploy``).

The app is the one ``inferline serve`` runs (:func:`serving.server.create_server`); its models of
``backend: ray`` reach their engine deployments (:mod:`serving.backends.ray_replica`) through handles.
"""

from __future__ import annotations

from typing import Any

from serving.backends.ray_deploy import INGRESS_NAME, ingress_options
from serving.backends.ray_replica import bind_engines
from serving.backends.ray_serve import serve
from serving.runtime.workspace import open_workspace
from serving.server import create_server


@serve.deployment(name="ingress")
@serve.ingress()
class Ingress:
    """The HTTP app (:func:`serving.server.create_server`) as the application's ingress; its models of ``backend: ray``
    reach their engine deployments through handles."""

    def __init__(self, config: str, **engines: Any):
        self._config = config

    def __serve_build_asgi_app__(self) -> Any:
        replica = serve.get_replica_context().replica_id.unique_id
        return with_replica_header(create_server(open_workspace(self._config), freeze_heap=True), replica)


#: The response header naming the ingress replica that answered (which one, when several share the load).
REPLICA_HEADER = b"x-inferline-replica"


def with_replica_header(app: Any, replica: str) -> Any:
    """ASGI *app* whose HTTP responses carry ``x-inferline-replica: <replica id>``."""
    header = (REPLICA_HEADER, replica.encode())

    async def tagged(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await app(scope, receive, send_tagged)

    return tagged


def build_app(args: dict[str, Any]) -> Any:
    """The application ``serve deploy`` builds from the file ``inferline deploy`` writes (``args: {config}``):
    the ingress with ``ray_ingress:``'s replicas (which the file's own deployment options override)."""
    workspace = open_workspace(args["config"])
    ingress = Ingress.options(name=INGRESS_NAME, **ingress_options(workspace.server))
    return ingress.bind(args["config"], **bind_engines(workspace.server, workspace.root))
