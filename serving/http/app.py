"""``create_app``: the Litestar app that serves every pipeline.

It loads every pipeline first (refusing to start, with every spec error
listed, if any is invalid); its lifespan then opens the key store, starts one
engine per configured model and marks the app ready; on shutdown it stops
taking new work, lets in-flight requests finish up to the grace period, and
closes the engines.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any

from litestar import Litestar, Request
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.plugins import PluginProtocol
from litestar.response import Response
from prometheus_client import CollectorRegistry

from pipeline import __version__
from pipeline.errors import InferlineError, SpecError, SpecIssue
from pipeline.protocols import EngineProvider
from serving.backends.audit_keys import can_sign, checkpoint_signer, public_keys
from serving.backends.audit_sink import content_vault
from serving.engine.heap import freeze_startup_heap, thaw
from serving.http import (
    anthropic_routes,
    anthropic_schemas,
    audit_routes,
    deploy_routes,
    embeddings_routes,
    openai_common,
    openai_routes,
    openapi,
    ops_routes,
    pipeline_routes,
    responses_routes,
    schemas,
    tokenize_routes,
)
from serving.http.auth import Authenticator
from serving.http.metrics import HttpMetrics
from serving.http.problems import Problem, from_error, title_for
from serving.http.refusals import RefusalRecorder
from serving.http.served import Executor
from serving.http.state import AppState
from serving.runtime.calls import check_calls
from serving.runtime.database import open_database
from serving.runtime.reloader import PipelineReloader
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.shadow import Shadows
from serving.runtime.workspace import DEFAULT_CONFIG, Workspace
from store.keys import KeyStore
from store.notify import listen
from store.responses import ResponseStore

logger = logging.getLogger(__name__)
#: ``Retry-After`` of the 503 ``starting`` answers while models load.
STARTING_RETRY_AFTER_S = 5


def create_app(workspace: Workspace, *, engines: EngineProvider | None = None, freeze_heap: bool = False,
               listen_while_starting: bool = False,
               plugins: Callable[[AppState], Sequence[PluginProtocol]] = lambda state: ()) -> Litestar:
    """The app for *workspace*; *engines* replaces the local model pool (tests pass fakes).

    *listen_while_starting* (``inferline serve``): the lifespan returns at once and opens the database,
    the models and the rest in the background, so that the server listens while models load:
    ``/healthz`` answers 200, ``/readyz`` and ``/health`` 503 until ready, every other route 503
    ``starting`` (:func:`_while_starting`). A failure to start is logged, turns ``/healthz`` to 503 and
    calls ``AppState.stop_serving``. Without it the lifespan waits until everything is open (an
    in-process client, the Ray ingress, whose replica takes traffic once its constructor returns).

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
    check_audit_keys(workspace)
    loaded = workspace.load_pipelines()
    check_calls(loaded)
    registry = CollectorRegistry()
    runtime = Runtime(workspace, loaded, RuntimeOptions.server(engines, registry))
    pipelines = runtime.pipelines
    metrics = HttpMetrics(registry, {name: pipeline.spec.slo for name, pipeline in pipelines.items()})
    executor = Executor(pipelines, runtime.runner, metrics, Shadows(runtime, registry=registry))
    runtime.calls.run = executor.run  # the score stages' judges, counted in the app's metrics
    state = AppState(workspace, executor, Authenticator(None, server.auth.enabled), runtime.pool, registry)
    state.refusals = refusals = RefusalRecorder(server.audit.refusals, state.auth, pipelines, registry)
    state.reloader = reloader = PipelineReloader(
        runtime, registry=registry, on_swap=lambda name, new: metrics.set_slo(name, new.spec.slo if new else None))

    async def start(stack: AsyncExitStack) -> None:
        """Open every resource onto *stack* (closed newest first), then mark the app ready."""
        await stack.enter_async_context(runtime)
        assert runtime.db is not None and runtime.audit_sink is not None  # opened by the runtime
        state.auth.keys = KeyStore(runtime.db)
        state.responses = ResponseStore(runtime.db)
        state.audit = runtime.audit
        state.audit_sink = refusals.sink = runtime.audit_sink
        stack.push_async_callback(refusals.settled, server.http.shutdown_grace_s)
        stack.push_async_callback(reloader.aclose)
        if executor.shadows is not None:
            stack.push_async_callback(executor.shadows.aclose, server.http.shutdown_grace_s)
        stack.push_async_callback(_drain, executor, server.http.shutdown_grace_s)
        for task in (asyncio.create_task(reloader.watch(server.reload.poll_s if server.reload.watch else None)),
                     asyncio.create_task(listen(runtime.db, reloader.trigger)),  # PostgreSQL: NOTIFY
                     asyncio.create_task(responses_routes.prune_expired(state.responses))):
            stack.push_async_callback(_cancelled, task)
        stack.callback(_reload_on_sighup(reloader.trigger))
        if freeze_heap:
            freeze_startup_heap()
            stack.callback(thaw)
        state.ready = True
        _log_start(workspace)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            starting = asyncio.create_task(start(stack))
            if listen_while_starting:
                starting.add_done_callback(lambda task: _start_ended(task, state))
            else:
                await starting  # a failure fails the lifespan: the server never listens
            try:
                yield
            finally:
                state.ready = False
                await _cancelled(starting)

    app = Litestar(
        route_handlers=[*pipeline_routes.ROUTES, *deploy_routes.ROUTES, *openai_routes.ROUTES,
                        *responses_routes.ROUTES, *anthropic_routes.ROUTES, *embeddings_routes.ROUTES,
                        *audit_routes.ROUTES,
                        *ops_routes.ROUTES, *tokenize_routes.ROUTES,
                        openapi.viewer_asset],
        lifespan=[lifespan],
        before_request=_while_starting,
        state=State({"inferline": state}),
        exception_handlers={Exception: _handle},
        # Logging is the process's: `inferline serve --log-level` configures it. Litestar's default
        # config would reset the root logger to INFO through a queue thread of its own, one more per
        # app, never stopped; _handle logs the unhandled errors.
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


def check_audit_keys(workspace: Workspace) -> None:
    """Refuse to start with an audit key that is not one, or a master key that does not unwrap the data
    keys the log holds (SpecError naming the setting)."""
    checkpoint_signer(workspace.server)
    public_keys(workspace.server, workspace.root)
    if workspace.server.audit.master_key:
        with open_database(workspace.database_url) as engine:
            content_vault(workspace.server, engine)
    if workspace.server.audit.anchors is not None and not can_sign(workspace.server, workspace.database_url):
        raise SpecError([SpecIssue("inferline.yaml", 1, 1, "audit.anchors", "digests are signed: set "
                                   "audit.signing_key (inferline audit keygen) or audit.checkpoint_key (the "
                                   "server makes a key of its own only for a SQLite file, with audit.local_key)")])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reload_on_sighup(reload: Callable[[], None]) -> Callable[[], None]:
    """SIGHUP reloads the pipelines folder, as it reloads nginx's and gunicorn's config; returns the undo.
    Only a process's main thread can take signals (an app in a test client's thread does without)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGHUP)


async def _while_starting(request: Request) -> None:
    """Until the app is ready only the routes marked ``opt={"while_starting": True}`` (liveness,
    readiness, the version, the OpenAPI document, static files) answer; the others get 503 ``starting``."""
    state = AppState.of(request)
    if state.ready or request.route_handler.opt.get("while_starting") or \
            request.url.path.startswith(request.app.openapi_config.path):  # type: ignore[union-attr]
        return
    if state.start_error:
        raise Problem(503, "Not ready", "the server failed to start; its log says why", "start_failed")
    raise Problem(503, "Starting", "the server is starting: models are loading; retry shortly", "starting",
                  {"Retry-After": str(STARTING_RETRY_AFTER_S)})


def _start_ended(task: asyncio.Task[None], state: AppState) -> None:
    """A background start that failed: logged with its cause, /healthz turns 503, the server stops."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    logger.error("the server failed to start: %s", exc if isinstance(exc, InferlineError) else
                 f"{type(exc).__name__}: {exc}", exc_info=None if isinstance(exc, InferlineError) else exc)
    state.start_error = str(exc) or type(exc).__name__
    if state.stop_serving is not None:
        state.stop_serving()


async def _drain(executor: Executor, grace_s: float) -> None:
    if not await executor.drain(grace_s):
        logger.warning("shutdown: %d request(s) still in flight after %.0f s", executor.in_flight, grace_s)


async def _cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel *task* and wait for it; what it raised is its own (a failed start was logged)."""
    task.cancel()
    with suppress(BaseException):
        await task


def _log_start(workspace: Workspace) -> None:
    server = workspace.server
    if not server.auth.enabled:
        logger.warning("auth is OFF: every request is allowed (only permitted on loopback, here %s)",
                       server.http.host)
    logger.info("serving %s on http://%s:%d", workspace.pipelines_dir, server.http.host, server.http.port)
    reload = (f"watched every {server.reload.poll_s:g} s and on SIGHUP" if server.reload.watch else "on SIGHUP")
    logger.info("pipelines reload %s; changes to %s (models, indexes, database) need a restart", reload,
                DEFAULT_CONFIG)


def _handle(request: Request, exc: Exception) -> Response[Any]:
    problem = _problem(exc)
    refusals = AppState.of(request).refusals
    if refusals is not None:
        refusals.note(request, problem)  # a refusal, of any route, is audited (off the answer's path)
    if request.url.path.startswith(anthropic_routes.PATH_PREFIX):
        return anthropic_routes.error_response(problem)
    if request.url.path.startswith("/v1/") or request.url.path in tokenize_routes.PATHS:
        return openai_common.error_response(problem)
    return pipeline_routes.problem_response(problem, request.url.path)


def _problem(exc: Exception) -> Problem:
    if isinstance(exc, (Problem, InferlineError)):
        return from_error(exc)
    if isinstance(exc, ValidationException):
        return _validation(exc)
    if isinstance(exc, RecursionError) and "deserializ" in str(exc):
        # msgspec refuses JSON nested past Python's recursion limit while decoding the body.
        return Problem(400, "Bad request", "the body is not valid JSON: it is nested too deeply", "malformed_json")
    if isinstance(exc, HTTPException):
        status = exc.status_code
        return Problem(status, title_for(status), str(exc.detail), title_for(status).lower().replace(" ", "_"),
                       dict(exc.headers or {}))
    logger.exception("unhandled error", exc_info=exc)
    return from_error(exc)


def _validation(exc: ValidationException) -> Problem:
    # Litestar raises ValidationException both for bodies that are not JSON
    # (400) and for JSON that does not fit the schema (422).
    errors = exc.extra if isinstance(exc.extra, list) else []
    if not errors or "decod" in str(exc.detail).lower():
        return Problem(400, "Bad request", f"the body is not valid JSON: {exc.detail}", "malformed_json")
    details = "; ".join(f"{e.get('key') or 'body'}: {e.get('message')}" for e in errors if isinstance(e, dict))
    return Problem(422, "Unprocessable request", details or str(exc.detail), "invalid_body", extra={"errors": errors})
