"""Models of ``backend: ray``: each one's engine runs as a Ray Serve deployment, reached by handle.

:class:`EngineDeployment` wraps our :class:`AsyncEngine` in a Ray Serve replica; its ``generate``
streams token events as plain dicts. :class:`RayEngine` is the pipeline's Engine protocol over the
deployment's handle (``handle.options(stream=True).generate.remote(...)``): Ray Serve picks the
replica, the tokenizer runs in the caller's process. The deployment options (replicas, autoscaling,
resources) come from each model's ``ray:`` section, see :mod:`serving.ray_deploy`.

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
from serving.ray_deploy import APP_NAME, deployment_name, deployment_options, ray_models

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

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any], cache_salt: str = "",
                       hints: dict[str, Any] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Token events as dicts; an engine error is one last ``{"error": kind, "message": ...}`` dict."""
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
            yield {"error": "overloaded", "message": str(exc), "retry_after_s": exc.retry_after_s}
            return
        except InvalidRequest as exc:
            yield {"error": "invalid", "message": str(exc)}
            return
        try:
            async for event in stream:
                yield asdict(event)
        except EngineDeadlineExceeded as exc:
            yield {"error": "deadline", "message": str(exc)}
        except EngineError as exc:
            yield {"error": "backend", "message": str(exc)}
        finally:
            # A caller that went away cancels this generator: abort the request, freeing its KV blocks.
            await stream.aclose()

    async def check_health(self) -> None:
        if self._engine.error is not None:
            raise RuntimeError(f"engine failed: {self._engine.error}")


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


def start_ray() -> None:
    """Connect to the Ray cluster of ``RAY_ADDRESS``, or start a local one (no dashboard)."""
    import os

    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(include_dashboard=False)


def run_engines(server: ServerSpec, root: Path) -> list[str]:
    """Deploy the engines of the ``backend: ray`` models (application ``inferline``, no HTTP route)."""
    engines = bind_engines(server, root)
    if engines:
        serve.run(EngineSet.bind(**engines), name=APP_NAME, route_prefix=None)
    return sorted(engines)


class _RayStream:
    """A deployment's response stream as the pipeline's TokenStream; its first event already read."""

    def __init__(self, owner: RayEngine, response: Any, first: TokenEvent, submitted_s: float):
        self._owner, self._response, self._first = owner, response, first
        self._submitted_s = submitted_s
        self._open = True

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        try:
            self._owner.observe_ttft(time.perf_counter() - self._submitted_s)
            yield self._first
            if self._first.finish_reason is not None:
                return
            async for item in self._response:
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
            first = self.event(await response.__anext__())
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
        return _RayStream(self, response, first, submitted_s)

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

        return create_app(open_workspace(self._config))


def build_app(args: dict[str, Any]) -> Any:
    """The application ``serve deploy`` builds from the file ``inferline deploy`` writes (``args: {config}``)."""
    from serving.wiring import open_workspace

    workspace = open_workspace(args["config"])
    return Ingress.bind(args["config"], **bind_engines(workspace.server, workspace.root))
