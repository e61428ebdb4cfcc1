"""Models of ``backend: ray``: each one's engine runs as a Ray Serve deployment, reached by handle.

:class:`EngineDeployment` wraps our :class:`AsyncEngine` in a Ray Serve replica; its ``generate``
streams token events as plain dicts, in lists: each list holds the events that were ready together
(one engine step's, or more when the caller reads slower than the engine steps), since every streamed
item costs a Ray object and a round of messages. :class:`RayEngine` is the pipeline's Engine protocol
over the deployment's handle (``handle.options(stream=True).generate.remote(...)``); the tokenizer runs
in the caller's process. Ray Serve picks the replica, through :class:`serving.ray_router.PrefixRouter`
for ``placement: prefix`` models. The deployment options (replicas, autoscaling, resources, router)
come from each model's ``ray:`` section, see :mod:`serving.ray_deploy`.

Needs the ``ray`` extra (``pip install 'inferline[ray]'``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.errors import BackendError, DeadlineExceeded, InvalidInput, Overloaded
from pipeline.protocols import PRIORITY_CLASSES, ModelLoad, SamplingParams, SchedulingHints
from pipeline.spec import ModelSpec, ServerSpec
from serving.engine.async_engine import AsyncEngine, TokenEvent
from serving.engine.errors import EngineDeadlineExceeded, EngineError, EngineOverloaded, InvalidRequest
from serving.engine.sampling_params import SamplingParams as EngineSampling
from serving.model_pool import HFTokenizer, engine_config, weights_sha256
from serving.placement import ewma
from serving.ray_deploy import APP_NAME, INGRESS_NAME, deployment_name, deployment_options, ingress_options, ray_models

with warnings.catch_warnings():
    # Ray Serve's own pydantic models use V1-style Field options; not ours to fix, and warnings are errors in tests.
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray import serve

logger = logging.getLogger(__name__)


@serve.deployment(name="engine")
class EngineDeployment:
    """One replica of a model's engine; Ray Serve runs as many as the model's ``ray:`` section says."""

    def __init__(self, name: str, spec: dict[str, Any], root: str, draft: dict[str, Any] | None = None):
        model = ModelSpec.model_validate(spec)
        # Resolved here, not by the caller: ``device: auto`` means this replica's node.
        config = engine_config(model, Path(root), ModelSpec.model_validate(draft) if draft else None)
        self._engine = AsyncEngine(config, name=name)
        self._started: asyncio.Task | None = None
        try:
            self._replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # built outside a replica (a test calling the class directly)
            self._replica = ""

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any], cache_salt: str = "",
                       hints: dict[str, Any] | None = None) -> AsyncIterator[list[dict[str, Any]]]:
        """Lists of token events as dicts, the first of the stream tagged with this replica's id
        (``"replica"``); an engine error is one last ``[{"error": kind, "message": ...}]``."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._engine.start())
        await asyncio.shield(self._started)
        hints = hints or {}
        deadline = hints.get("deadline_in_s")
        try:
            stream = await self._engine.submit(
                prompt_ids, EngineSampling(**sampling), cache_salt, priority=hints.get("priority", 0),
                tenant=hints.get("tenant", ""), deadline_s=None if deadline is None else time.perf_counter() + deadline)
        except EngineOverloaded as exc:
            yield [{"error": "overloaded", "message": str(exc), "retry_after_s": exc.retry_after_s}]
            return
        except InvalidRequest as exc:
            yield [{"error": "invalid", "message": str(exc)}]
            return
        tag: dict[str, Any] | None = {"replica": self._replica}
        try:
            async for events in ready_batches(stream):
                items = [asdict(event) for event in events]
                if tag is not None:
                    items[0], tag = {**items[0], **tag}, None
                yield items
        except EngineDeadlineExceeded as exc:
            yield [{"error": "deadline", "message": str(exc)}]
        except EngineError as exc:
            yield [{"error": "backend", "message": str(exc)}]
        finally:
            # A caller that went away cancels this generator: abort the request, freeing its KV blocks.
            await stream.aclose()

    async def check_health(self) -> None:
        if self._engine.error is not None:
            raise RuntimeError(f"engine failed: {self._engine.error}")


async def ready_batches(stream: AsyncIterator[TokenEvent]) -> AsyncIterator[list[TokenEvent]]:
    """*stream*'s events in lists: each list holds every event that arrived while the previous one was
    being sent. The stream's error is raised after the events before it; closing this closes *stream*."""
    queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in stream:
                queue.put_nowait(event)
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            last = batch[-1]  # the end (None) or an error comes last, and alone after the events
            events = batch if isinstance(last, TokenEvent) else batch[:-1]
            if events:
                yield events
            if isinstance(last, BaseException):
                raise last
            if last is None:
                return
    finally:
        task.cancel()


@serve.deployment(name="engines", num_replicas=1, ray_actor_options={"num_cpus": 0})
class EngineSet:
    """The root of an application of engines alone (``inferline serve --ray``): Ray Serve needs one."""

    def __init__(self, **engines: Any):
        self.models = sorted(engines)

    def __call__(self) -> list[str]:
        return self.models


def bind_engines(server: ServerSpec, root: Path) -> dict[str, Any]:
    """Each ``backend: ray`` model's bound engine deployment, with its ``ray:`` options."""
    bound = {}
    for name, spec in ray_models(server).items():
        draft = spec.speculative.draft_model if spec.speculative else None
        draft_spec = server.models[draft].model_dump(mode="json", exclude_unset=True) if draft else None
        bound[name] = EngineDeployment.options(name=deployment_name(name), **deployment_options(spec)).bind(
            name, spec.model_dump(mode="json", exclude_unset=True), str(root.resolve()), draft_spec)
    return bound


def start_ray() -> bool:
    """Connect to the Ray cluster of ``RAY_ADDRESS``, or start a local one (no dashboard); True when local."""
    import os

    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    ray.init(include_dashboard=False)
    return True


def stop_ray(local: bool) -> None:
    """Leave Ray: a local Ray (``start_ray`` returned True) is shut down with its Serve applications; on a
    cluster the engines stay deployed for the other ingresses (``serve delete inferline`` removes them)."""
    import ray

    if local:
        serve.shutdown()
    ray.shutdown()


def run_engines(server: ServerSpec, root: Path) -> list[str]:
    """Deploy the engines of the ``backend: ray`` models (application ``inferline``, no HTTP route)."""
    engines = bind_engines(server, root)
    if engines:
        serve.run(EngineSet.bind(**engines), name=APP_NAME, route_prefix=None)
    return sorted(engines)


class _RayStream:
    """A deployment's response stream as the pipeline's TokenStream; its first item already read."""

    def __init__(self, owner: RayEngine, response: Any, first: TokenEvent, rest: list[dict[str, Any]],
                 submitted_s: float, replica: str):
        self._owner, self._response, self._first, self._rest = owner, response, first, rest
        self._submitted_s = submitted_s
        #: The id of the Ray Serve replica that serves this request ("" when it did not say).
        self.replica = replica
        self._open = True

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        try:
            self._owner.observe_ttft(time.perf_counter() - self._submitted_s)
            yield self._first
            if self._first.finish_reason is not None:
                return
            for item in self._rest:
                event = self._owner.event(item)
                yield event
                if event.finish_reason is not None:
                    return
            async for items in self._response:
                for item in _as_list(items):
                    event = self._owner.event(item)
                    yield event
                    if event.finish_reason is not None:
                        return
        except (BackendError, DeadlineExceeded):
            raise
        except Exception as exc:  # a replica that died mid-stream arrives as one of Ray's errors
            raise BackendError(f"model {self._owner.name!r}: the Ray Serve replica failed: {exc}") from exc
        finally:
            self._release()

    async def aclose(self) -> None:
        if self._open:
            self._response.cancel()
        self._release()

    def _release(self) -> None:
        if self._open:
            self._open = False
            self._owner.outstanding -= 1


class RayEngine:
    """The pipeline's Engine protocol over a model's Ray Serve deployment handle."""

    def __init__(self, name: str, handle: Any, tokenizer: HFTokenizer, weights_hash: str):
        self.name = name
        self.handle = handle
        self.tokenizer = tokenizer
        self.weights_hash = weights_hash
        #: Requests submitted here whose stream has not ended (this process's view of the load).
        self.outstanding = 0
        self.ttft_s: float | None = None

    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str = "", *,
                     hints: SchedulingHints | None = None) -> _RayStream:
        submitted_s = time.perf_counter()
        hints = hints or SchedulingHints()
        # perf_counter is per process: the deadline travels as seconds from now.
        remote_hints = {"priority": PRIORITY_CLASSES.index(hints.priority), "tenant": hints.tenant,
                        "deadline_in_s": None if hints.deadline_s is None else hints.deadline_s - submitted_s}
        response = self.handle.options(stream=True).generate.remote(
            list(prompt_ids), asdict(sampling), cache_salt, remote_hints)
        self.outstanding += 1
        try:
            # Read the first event now, so that overload and invalid input raise here, as a local engine's do.
            items = _as_list(await response.__anext__())
            if not items:
                raise StopAsyncIteration
            replica = str(items[0].pop("replica", ""))
            first = self.event(items[0])
        except StopAsyncIteration:
            self.outstanding -= 1
            raise BackendError(f"model {self.name!r}: the Ray Serve replica ended the stream without a token") from None
        except (Overloaded, InvalidInput, BackendError, DeadlineExceeded):
            self.outstanding -= 1
            raise
        except asyncio.CancelledError:
            # A caller that gave up before the first token (a route's first_token_timeout_s): the request
            # is no longer outstanding here, and Ray Serve should not run it.
            self.outstanding -= 1
            response.cancel()
            raise
        except Exception as exc:
            self.outstanding -= 1
            raise BackendError(f"model {self.name!r}: Ray Serve: {exc}") from exc
        return _RayStream(self, response, first, items[1:], submitted_s, replica)

    def event(self, item: dict[str, Any]) -> TokenEvent:
        """A deployment's dict as a token event; its error dicts as the pipeline's errors."""
        kind = item.get("error")
        if kind is None:
            top = tuple(tuple(pair) for pair in item.get("top_logprobs", ()))
            return TokenEvent(**{**item, "top_logprobs": top})
        message = f"model {self.name!r}: {item['message']}"
        if kind == "overloaded":
            raise Overloaded(f"model {self.name!r} is overloaded: {item['message']}", item.get("retry_after_s") or 1.0)
        if kind == "invalid":
            raise InvalidInput(item["message"])
        if kind == "deadline":
            raise DeadlineExceeded(message)
        raise BackendError(message)

    def load(self) -> ModelLoad:
        return ModelLoad(0, self.outstanding, self.ttft_s)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s = ewma(self.ttft_s, seconds)

    async def aclose(self) -> None:
        """Nothing to free here: the deployment's replicas belong to Ray Serve."""


def _as_list(item: Any) -> list[dict[str, Any]]:
    # A list of events per item; a replica of an older version streamed one dict per item.
    return item if isinstance(item, list) else [item]


async def open_ray_engine(name: str, spec: ModelSpec, root: Path) -> RayEngine:
    """A :class:`RayEngine` for model *name*, whose deployment runs in application ``inferline``."""
    from transformers import AutoTokenizer

    try:
        handle = serve.get_deployment_handle(deployment_name(name), app_name=APP_NAME)
    except Exception as exc:
        raise BackendError(f"model {name!r}: no Ray Serve deployment {deployment_name(name)!r} in application "
                           f"{APP_NAME!r} (start it with `inferline serve --ray` or `serve deploy`): {exc}") from exc
    source = root / (spec.source or "")
    if source.is_file():
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, source.parent, gguf_file=source.name)
    else:
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, source, local_files_only=True)
    weights_hash = await asyncio.to_thread(weights_sha256, source)
    logger.info("model %s: Ray Serve deployment %s, weights sha256 %s", name, deployment_name(name), weights_hash[:12])
    return RayEngine(name, handle, HFTokenizer(tokenizer), weights_hash)


@serve.deployment(name="ingress")
@serve.ingress()
class Ingress:
    """The HTTP app (``serving.app.create_app``) as the application's ingress; its models of ``backend: ray``
    reach their engine deployments through handles."""

    def __init__(self, config: str, **engines: Any):
        self._config = config

    def __serve_build_asgi_app__(self) -> Any:
        from serving.app import create_app
        from serving.wiring import open_workspace

        replica = serve.get_replica_context().replica_id.unique_id
        return with_replica_header(create_app(open_workspace(self._config), freeze_heap=True), replica)


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
    from serving.wiring import open_workspace

    workspace = open_workspace(args["config"])
    ingress = Ingress.options(name=INGRESS_NAME, **ingress_options(workspace.server))
    return ingress.bind(args["config"], **bind_engines(workspace.server, workspace.root))
