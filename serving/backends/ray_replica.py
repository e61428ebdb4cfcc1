"""The replicas of ``backend: ray`` models: our engine in a Ray Serve deployment, and their deployment.

:class:`EngineDeployment` wraps an :class:`AsyncEngine` in a Ray Serve replica; its ``generate``
streams token events as plain dicts, in lists: each list holds the events that were ready together
(one engine step's, or more when the caller reads slower than the engine steps), since every streamed
item costs a Ray object and a round of messages. The deployment options (replicas, autoscaling,
resources, router) come from each model's ``ray:`` section, see :mod:`serving.backends.ray_deploy`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from serving.backends.engine_config import engine_config
from serving.backends.ray_deploy import APP_NAME, deployment_name, deployment_options, ray_models
from serving.backends.ray_serve import serve
from serving.config.models import ModelSpec
from serving.config.server import ServerSpec
from serving.engine.async_engine import AsyncEngine, TokenEvent
from serving.engine.errors import EngineDeadlineExceeded, EngineError, EngineOverloaded, InvalidRequest
from serving.engine.sampling_params import SamplingParams as EngineSampling


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


def run_engines(server: ServerSpec, root: Path) -> list[str]:
    """Deploy the engines of the ``backend: ray`` models (application ``inferline``, no HTTP route)."""
    engines = bind_engines(server, root)
    if engines:
        serve.run(EngineSet.bind(**engines), name=APP_NAME, route_prefix=None)
    return sorted(engines)
