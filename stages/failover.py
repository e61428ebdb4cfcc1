"""Submitting to a model with fallbacks: what ``generate`` does with the ``route`` stage's plan.

The models are tried in order (the routed one, then its fallbacks). Each gets
``retries`` extra attempts; an error, an overload (429) or no first token
within ``first_token_timeout_s`` moves on to the next. A model that failed is
left out of rotation for ``cooldown_s`` (the last candidate is always tried).
A fallback with another tokenizer gets the prompt tokenized again; a remote
backend gets the chat messages. Fallback happens before the first token only:
once text has reached the client, a failure ends the request. A request still
queued at its deadline (``DeadlineExceeded``) does not fall back: the deadline
has passed for every model.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipeline.context import RequestContext, RoutePlan, chat_turns
from pipeline.errors import BackendError, InvalidInput, Overloaded
from pipeline.protocols import ChatEngine, Engine, Resources, SamplingParams, SchedulingHints, TokenEvent, TokenStream
from stages.engines import engine_for

#: Errors that move on to the next model; anything else (a bad request) ends the request.
RETRYABLE = (Overloaded, BackendError)


async def submit_with_fallback(resources: Resources, ctx: RequestContext, sampling: SamplingParams,
                               salt: str, hints: SchedulingHints | None = None) -> tuple[str, Engine, TokenStream]:
    plan = ctx.route_plan or RoutePlan()
    first = ctx.model or (resources.engines.default_model if resources.engines else "")
    candidates = [first, *(m for m in plan.fallbacks if m != first)]
    tried: list[dict[str, Any]] = []
    error: Exception | None = None
    for index, name in enumerate(candidates):
        if resources.cooldowns.get(name, 0.0) > time.monotonic() and index < len(candidates) - 1:
            tried.append({"model": name, "error": "cooldown"})
            continue
        for attempt in range(1 + plan.retries):
            try:
                engine, stream = await _submit(resources, ctx, name, sampling, salt, plan, hints)
            except RETRYABLE as exc:
                error = error or exc  # the first model's error is the one to report if all fail
                tried.append({"model": name, "attempt": attempt + 1, "error": exc.kind})
                rest = exc.retry_after_s if isinstance(exc, Overloaded) else plan.cooldown_s
                continue
            except InvalidInput as exc:
                if index == 0:
                    raise  # the request itself is at fault
                tried.append({"model": name, "attempt": attempt + 1, "error": exc.kind})  # e.g. too small a window
                rest = 0.0
                break
            resources.cooldowns.pop(name, None)
            _record(ctx, name, tried)
            return name, engine, stream
        if rest:  # a full model rests as long as it asked; a failing one, cooldown_s
            resources.cooldowns[name] = time.monotonic() + min(rest, plan.cooldown_s)
    _record(ctx, None, tried)
    raise error if error is not None else BackendError("no model could take the request")


async def _submit(resources: Resources, ctx: RequestContext, name: str, sampling: SamplingParams, salt: str,
                  plan: RoutePlan, hints: SchedulingHints | None) -> tuple[Engine, TokenStream]:
    """Submit to *name* and read its first event (an error before any text still falls back). A deadline
    covers the submission and the first token, not the model's start (a cold start takes what it takes)."""
    name, engine = await engine_for(resources, name)
    if plan.first_token_timeout_s is None:
        return engine, await _first_token(await _open(engine, ctx, name, sampling, salt, hints))
    try:
        async with asyncio.timeout(plan.first_token_timeout_s):
            return engine, await _first_token(await _open(engine, ctx, name, sampling, salt, hints))
    except TimeoutError:
        raise BackendError(f"model {name!r} gave no first token within {plan.first_token_timeout_s:g} s") from None


async def _open(engine: Engine, ctx: RequestContext, name: str, sampling: SamplingParams, salt: str,
                hints: SchedulingHints | None) -> TokenStream:
    if isinstance(engine, ChatEngine):
        return await engine.submit_messages(chat_turns(ctx.messages), sampling, cache_salt=salt)
    if name != ctx.facts.get("prompt_model", ctx.model):  # another tokenizer than the prompt's: encode again
        ctx.prompt_ids = engine.tokenizer.encode_chat(chat_turns(ctx.messages))
        ctx.prompt_tokens = len(ctx.prompt_ids)
        ctx.facts["prompt_model"] = name
    return await engine.submit(ctx.prompt_ids, sampling, cache_salt=salt, hints=hints)


async def _first_token(stream: TokenStream) -> TokenStream:
    """*stream* with its first event already read (the caller times that); closed if the wait is cancelled."""
    events = stream.__aiter__()
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise
    return _Primed(first, events, stream)


class _Primed:
    """A token stream whose first event was already read (to time it)."""

    def __init__(self, first: TokenEvent | None, rest: Any, stream: TokenStream):
        self._first, self._rest, self._stream = first, rest, stream

    def __aiter__(self) -> Any:
        return self._events()

    async def _events(self) -> Any:
        if self._first is None:
            return
        yield self._first
        async for event in self._rest:
            yield event

    async def aclose(self) -> None:
        await self._stream.aclose()


def _record(ctx: RequestContext, served: str | None, tried: list[dict[str, Any]]) -> None:
    route = ctx.facts.setdefault("route", {})
    route["served_by"] = served
    if tried:
        route["fallbacks_tried"] = tried
