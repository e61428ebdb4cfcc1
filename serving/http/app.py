"""``create_app``: the Litestar app that serves every pipeline, built from the server's settings.

The factory opens nothing: it checks the settings it can check without opening anything (the address
against auth; the pipeline files as a set, refusing to build with every spec error listed), and builds the
app: its state (serving/http/state.py), its three routers (serving/http/routers.py), its plugins and its
OpenAPI document. The lifespan (serving/http/lifespan.py) opens the database, the models and the rest,
makes the handlers' services of them, and closes them on shutdown.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.plugins import PluginProtocol
from prometheus_client import CollectorRegistry

from pipeline import __version__
from pipeline.errors import SpecError, SpecIssue
from pipeline.protocols import EngineProvider
from serving.backends.audit_keys import checkpoint_signer, public_keys
from serving.http import anthropic_schemas, embeddings_routes, openapi, schemas, tokenize_routes
from serving.http.lifespan import lifespan
from serving.http.routers import problem_errors, routers, while_starting
from serving.http.state import AppState
from serving.runtime.workspace import Workspace


def create_app(workspace: Workspace, *, engines: EngineProvider | None = None, freeze_heap: bool = False,
               listen_while_starting: bool = False,
               plugins: Callable[[AppState], Sequence[PluginProtocol]] = lambda state: ()) -> Litestar:
    """The app for *workspace*; *engines* replaces the local model pool (tests pass fakes).

    *listen_while_starting* (``inferline serve``): the lifespan returns at once and opens the database,
    the models and the rest in the background, so that the server listens while models load:
    ``/healthz`` answers 200, ``/readyz`` and ``/health`` 503 until ready, every other route 503
    ``starting`` (:func:`serving.http.routers.while_starting`). A failure to start is logged, turns
    ``/healthz`` to 503 and calls ``AppState.stop_serving``. Without it the lifespan waits until everything
    is open (an in-process client, the Ray ingress, whose replica takes traffic once its constructor returns).

    *plugins* builds the plugins that extend it from its state (:func:`serving.server.create_server`
    adds the web console this way).

    *freeze_heap* (a serving process: ``inferline serve``, the Ray ingress): once started, the heap
    is collected and frozen (serving/engine/heap.py) until shutdown. A local engine freezes its own
    on start; this covers what the app loads besides, and a process with no engine of its own (the
    Ray ingress: tokenizers, the app, Ray's client side), where one collection of the oldest
    generation would stop every stream while it walks the heap.
    """
    server = workspace.server
    check_bind(workspace)
    checkpoint_signer(server)  # keys that are not keys: refused before anything opens
    public_keys(server, workspace.root)
    state = AppState(workspace, tuple(workspace.load_pipelines()), CollectorRegistry())
    app = Litestar(
        route_handlers=routers(),
        lifespan=[lifespan(state, engines=engines, freeze_heap=freeze_heap,
                           listen_while_starting=listen_while_starting)],
        before_request=while_starting,
        state=State({"inferline": state}),
        exception_handlers={Exception: problem_errors},  # a request no route takes (404, 405)
        # Logging is the process's: `inferline serve --log-level` configures it. Litestar's default
        # config would reset the root logger to INFO through a queue thread of its own, one more per
        # app, never stopped; the routers' handlers log the unhandled errors.
        logging_config=None,
        plugins=list(plugins(state)),
        request_max_body_size=server.http.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Inferline", version=__version__, path="/schema",
                                     description="Every pipeline an endpoint; OpenAI- and Anthropic-compatible APIs.",
                                     components=openapi.components(), render_plugins=openapi.render_plugins(),
                                     security=openapi.SECURITY if server.auth.enabled else None),
    )
    openapi.use_pydantic_schemas(app, schemas.PipelineRequest, schemas.ChatCompletionRequest,
                               schemas.CompletionRequest, schemas.ResponsesRequest, schemas.DeployRequest,
                               schemas.ActivateRequest, schemas.TrafficRequest, schemas.ShadowRequest,
                               tokenize_routes.TokenizeRequest, tokenize_routes.DetokenizeRequest,
                               anthropic_schemas.MessagesRequest, anthropic_schemas.CountTokensRequest,
                               embeddings_routes.EmbeddingRequest)
    return app


def check_bind(workspace: Workspace) -> None:
    """Refuse to serve without auth anywhere but loopback."""
    http, auth = workspace.server.http, workspace.server.auth
    if not auth.enabled and not is_loopback(http.host):
        raise SpecError([SpecIssue("inferline.yaml", 1, 1, "auth.enabled",
                                   f"auth is off, so binding {http.host} is refused: turn auth on "
                                   f"(auth: {{enabled: true}}) or bind 127.0.0.1")])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
