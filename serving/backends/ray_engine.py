"""The pipeline's Engine protocol over a ``backend: ray`` model's Ray Serve deployment handle.

:class:`RayEngine` calls ``handle.options(stream=True).generate.remote(...)`` on the deployment of
:mod:`serving.backends.ray_replica`; the tokenizer runs in the caller's process. Ray Serve picks the
replica, through :class:`serving.backends.ray_router.PrefixRouter` for ``placement: prefix`` models.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.errors import BackendError, DeadlineExceeded, InvalidInput, Overloaded
from pipeline.protocols import PRIORITY_CLASSES, ModelOccupancy, SamplingParams, SchedulingHints
from serving.backends.placement import ewma
from serving.backends.ray_deploy import APP_NAME, deployment_name
from serving.backends.ray_serve import serve
from serving.backends.tokenizer import HFTokenizer
from serving.backends.weights import weights_sha256
from serving.config.models import ModelSpec
from serving.engine.async_engine import TokenEvent

logger = logging.getLogger(__name__)


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

    def occupancy(self) -> ModelOccupancy:
        return ModelOccupancy(0, self.outstanding, self.ttft_s)

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
        from serving.engine.blocks import chat_template

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, source.parent, gguf_file=source.name)
        # transformers' GGUF tokenizer leaves the file's chat template out
        tokenizer.chat_template = tokenizer.chat_template or await asyncio.to_thread(chat_template, source)
    else:
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, source, local_files_only=True)
    weights_hash = await asyncio.to_thread(weights_sha256, source)
    logger.info("model %s: Ray Serve deployment %s, weights sha256 %s", name, deployment_name(name), weights_hash[:12])
    return RayEngine(name, handle, HFTokenizer(tokenizer), weights_hash)
