"""The app's lifespan: it opens every resource the handlers use, starts the app with them, and closes them.

On start (:func:`open_services`): the audit keys are checked against the database, the runtime opens
(database, audit store and sink, counters, indexes, versions, one engine per model), and the app's own
parts are made over it (the executor that counts requests, the reloader that follows the pipelines
folder, the refusal recorder, the key and response stores, the MCP sessions of ``/mcp``, which the
reloader tells of changed pipelines); the reloader's watch, PostgreSQL's change
notices and the stored responses' pruning run as tasks; SIGHUP reloads. Then :class:`Services` is made
whole and the app started (:meth:`AppState.start`). On shutdown it stops taking new work, lets in-flight
requests finish up to ``http.shutdown_grace_s``, and closes everything, newest first.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from functools import reduce
from typing import Any

from litestar import Litestar

from pipeline.errors import InferlineError, SpecError, SpecIssue
from pipeline.protocols import EngineProvider
from pipeline.runner import Pipeline
from serving.backends.audit_keys import can_sign, checkpoint_signer, public_keys
from serving.backends.audit_sink import content_vault
from serving.engine.heap import freeze_startup_heap, thaw
from serving.http import mcp_routes
from serving.http.auth import Authenticator
from serving.http.mcp_server import McpSessions
from serving.http.metrics import HttpMetrics
from serving.http.refusals import RefusalRecorder
from serving.http.responses_routes import prune_expired
from serving.http.served import Executor
from serving.http.services import Services
from serving.http.state import AppState
from serving.runtime.database import open_database
from serving.runtime.reloader import PipelineReloader
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.shadow import Shadows
from serving.runtime.workspace import DEFAULT_CONFIG, Workspace
from store.keys import KeyStore
from store.notify import listen
from store.responses import ResponseStore

logger = logging.getLogger(__name__)


def lifespan(state: AppState, *, engines: EngineProvider | None, freeze_heap: bool,
             listen_while_starting: bool) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """The lifespan of the app of *state*; the arguments are :func:`serving.http.app.create_app`'s."""

    @asynccontextmanager
    async def run(app: Litestar) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            starting = asyncio.create_task(_start(state, stack, engines, freeze_heap))
            if listen_while_starting:
                starting.add_done_callback(lambda task: _start_ended(task, state))
            else:
                await starting  # a failure fails the lifespan: the server never listens
            try:
                yield
            finally:
                state.stop()
                await _cancelled(starting)

    return run


async def _start(state: AppState, stack: AsyncExitStack, engines: EngineProvider | None, freeze_heap: bool) -> None:
    services = await open_services(state, stack, engines)
    if freeze_heap:
        freeze_startup_heap()
        stack.callback(thaw)
    state.start(services)
    _log_start(state.workspace)


async def open_services(state: AppState, stack: AsyncExitStack, engines: EngineProvider | None) -> Services:
    """Open everything the handlers use onto *stack* (closed newest first); *engines* replaces the model pool."""
    workspace, registry = state.workspace, state.registry
    server = workspace.server
    await asyncio.to_thread(check_audit_keys, workspace)
    metrics = HttpMetrics(registry, {item.spec.name: item.spec.slo for item in state.loaded})

    def executor_of(runtime: Runtime) -> Executor:
        runner = reduce(lambda inner, layer: layer(inner), state.runner_layers, runtime.runner)
        return Executor(runtime.pipelines, runner, metrics, Shadows(runtime.deployments, runtime.runner,
                                                                    registry=registry))

    # The executor runs the judges' and sub-pipelines' requests too: they count in the app's metrics.
    runtime = Runtime(workspace, state.loaded, RuntimeOptions.server(engines, registry), requests=executor_of)
    executor = runtime.requests
    if not isinstance(executor, Executor):
        raise TypeError("the runtime's requests are not the app's executor")
    mcp: McpSessions | None = None

    def swapped(name: str, new: Pipeline | None) -> None:
        metrics.set_slo(name, new.spec.slo if new else None)
        if mcp is not None:
            mcp.tools_changed()

    reloader = PipelineReloader(runtime, registry=registry, on_swap=swapped)
    await stack.enter_async_context(runtime)
    db, audit, sink = runtime.db, runtime.audit, runtime.audit_sink
    if db is None or audit is None or sink is None:
        raise RuntimeError("the runtime opened no database or audit store")
    auth = Authenticator(KeyStore(db), server.auth.enabled)
    refusals = RefusalRecorder(server.audit.refusals, auth, runtime.pipelines, registry, sink, state.key_cookie)
    mcp = McpSessions(auth, server.http.max_body_bytes, mcp_routes.list_tools, mcp_routes.call_tool)
    await _serving(stack, mcp)  # closed after the requests in flight, the MCP calls among them, have drained
    services = Services(runtime=runtime, executor=executor, auth=auth, reloader=reloader, refusals=refusals,
                        audit=audit, audit_sink=sink, responses=ResponseStore(db), mcp=mcp)
    grace_s = server.http.shutdown_grace_s
    stack.push_async_callback(refusals.settled, grace_s)
    stack.push_async_callback(reloader.aclose)
    if executor.shadows is not None:
        stack.push_async_callback(executor.shadows.aclose, grace_s)
    stack.push_async_callback(_drain, executor, grace_s)
    for task in (asyncio.create_task(reloader.watch(server.reload.poll_s if server.reload.watch else None)),
                 asyncio.create_task(listen(db, reloader.trigger)),  # PostgreSQL: NOTIFY
                 asyncio.create_task(prune_expired(services.responses))):
        stack.push_async_callback(_cancelled, task)
    stack.callback(_reload_on_sighup(reloader.trigger))
    return services


async def _serving(stack: AsyncExitStack, mcp: McpSessions) -> None:
    """Run *mcp*'s sessions in a task of their own (see :meth:`McpSessions.serve`), cancelled by *stack*."""
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(mcp.serve(started))
    stack.push_async_callback(_cancelled, task)
    await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # it failed to start: raise why


def check_audit_keys(workspace: Workspace) -> None:
    """Refuse to start with an audit key that is not one, or a master key that does not unwrap the data
    keys the log holds (SpecError naming the setting). Blocking: it opens the database."""
    checkpoint_signer(workspace.server)
    public_keys(workspace.server, workspace.root)
    if workspace.server.audit.master_key:
        with open_database(workspace.database_url) as engine:
            content_vault(workspace.server, engine)
    if workspace.server.audit.anchors is not None and not can_sign(workspace.server, workspace.database_url):
        raise SpecError([SpecIssue("inferline.yaml", 1, 1, "audit.anchors", "digests are signed: set "
                                   "audit.signing_key (inferline audit keygen) or audit.checkpoint_key (the "
                                   "server makes a key of its own only for a SQLite file, with audit.local_key)")])


def _reload_on_sighup(reload: Callable[[], None]) -> Callable[[], None]:
    """SIGHUP reloads the pipelines folder, as it reloads nginx's and gunicorn's config; returns the undo.
    Only a process's main thread can take signals (an app in a test client's thread does without)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGHUP)


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
