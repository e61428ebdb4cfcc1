"""Rate limits and budgets for the ``policy`` stage, kept in shared counters.

Three limits, each optional, counted per API key (or tenant, client address,
or the whole pipeline):

* ``requests_per_minute``: one request is counted when it arrives;
* ``tokens_per_day``: before any prefill, the prompt's tokens plus the output
  it may generate are *reserved* atomically; what was not used is given back
  when the request ends, so concurrent requests can never overshoot the budget;
* ``cost_per_day_usd``: a request is refused once the day's spend has reached
  the limit; its actual cost is added when it ends (the cost of a request is
  only known afterwards, so concurrent requests may pass the limit by at most
  their own cost).

Days are UTC days. What is left is written to ``ctx.facts["limits"]``, which
the HTTP layer turns into ``X-RateLimit-*`` and ``X-Budget-*`` headers.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from pipeline.context import RequestContext
from pipeline.errors import BackendError, InferlineError, RateLimited
from pipeline.protocols import Counters, Resources
from pipeline.protocols import CounterState as Count
from pipeline.stage import NoConfig

MINUTE_S = 60
DAY_S = 86_400


class LimitValues(NoConfig):
    #: Requests per minute.
    requests_per_minute: PositiveInt | None = None
    #: Prompt and output tokens per UTC day.
    tokens_per_day: PositiveInt | None = None
    #: USD spent per UTC day.
    cost_per_day_usd: PositiveFloat | None = None


class LimitsConfig(LimitValues):
    #: Whose counter a request counts against: ``user`` is the end user the request names (OpenAI's
    #: ``user``, Anthropic's ``metadata.user_id``, the ``user`` tag), counted within the caller's key.
    per: Literal["key", "tenant", "client", "pipeline", "user"] = "key"
    #: Limits for particular API key ids, tenant names or (``per: user``) users; each value set replaces
    #: the default.
    overrides: dict[str, LimitValues] = Field(default_factory=dict)
    #: Output tokens reserved from ``tokens_per_day`` when the policy sets no ``max_output_tokens``;
    #: generation is capped at what was reserved.
    reserve_output_tokens: PositiveInt = 512

    @property
    def counts_tokens(self) -> bool:
        return self.tokens_per_day is not None or any(o.tokens_per_day for o in self.overrides.values())

    def values_for(self, ctx: RequestContext) -> LimitValues:
        principal = ctx.principal
        override = None
        if self.per == "user" and ctx.tags.get("user"):
            override = self.overrides.get(ctx.tags["user"])
        if override is None and principal is not None:
            override = self.overrides.get(principal.key_id) or self.overrides.get(principal.tenant)
        if override is None:
            return self
        return LimitValues(**{**self.model_dump(include=set(LimitValues.model_fields)),
                              **override.model_dump(exclude_unset=True)})

    def subject(self, ctx: RequestContext) -> str:
        if self.per == "pipeline":
            return "all"
        if self.per == "client":
            return ctx.client_addr or "unknown"
        principal = ctx.principal
        key = principal.key_id if principal is not None else "anonymous"
        if self.per == "user":  # within the key: one key's users never use up another key's budgets
            return f"{key}/{ctx.tags.get('user', '')}"
        if principal is None:
            return "anonymous"
        return principal.tenant if self.per == "tenant" else principal.key_id


class Limits:
    """Enforces one policy stage's limits for one request."""

    def __init__(self, stage_id: str, config: LimitsConfig, resources: Resources):
        self.stage_id = stage_id
        self.config = config
        self.resources = resources  # counters are wired in when the server starts, after the stages exist

    async def enforce(self, ctx: RequestContext, input_tokens: int, max_output: int | None) -> int | None:
        """Count the request; raise RateLimited when a limit is used up; return the output-token cap."""
        values = self.config.values_for(ctx)
        if ctx.shadow_of:  # a shadow run mirrors a request counted already: it uses up no caller's budget
            return max_output
        if not (values.requests_per_minute or values.tokens_per_day or values.cost_per_day_usd):
            return max_output
        counters = self._counters()
        base = f"{ctx.pipeline}:{self.config.per}:{self.config.subject(ctx)}"
        report: dict[str, Any] = ctx.facts.setdefault("limits", {})
        counted: Count | None = None
        try:
            if values.requests_per_minute:
                counted = await self._requests(counters, f"{base}:requests", values.requests_per_minute, report)
            if values.cost_per_day_usd:
                await self._cost(ctx, counters, f"{base}:cost", values.cost_per_day_usd, report)
            if values.tokens_per_day:
                limit = values.tokens_per_day
                max_output = await self._tokens(ctx, counters, f"{base}:tokens", limit, input_tokens,
                                                max_output or self.config.reserve_output_tokens, report)
        except RateLimited as exc:
            if counted is not None and exc.rule != "limits.requests_per_minute":
                # Refused by a budget: the request never ran, so it does not use up a slot of the minute.
                await counters.add(f"{base}:requests", -1, MINUTE_S, counted.window_start)
                report["requests"]["remaining"] += 1
            raise
        except InferlineError:
            raise
        except Exception as exc:  # the counter store is down: refuse rather than serve unmetered
            raise BackendError(f"policy {self.stage_id!r}: the rate-limit store cannot be reached") from exc
        return max_output

    async def _requests(self, counters: Counters, key: str, limit: int, report: dict[str, Any]) -> Count:
        state = await counters.consume(key, 1, limit, MINUTE_S)
        report["requests"] = _entry(limit, limit - state.used, state.reset_s)
        if not state.allowed:
            raise self._refuse("requests_per_minute", f"the limit of {limit} requests per minute is reached",
                               state.reset_s)
        return state

    async def _cost(self, ctx: RequestContext, counters: Counters, key: str, limit: float,
                    report: dict[str, Any]) -> None:
        state = await counters.get(key, DAY_S)
        report["cost_usd"] = _entry(limit, limit - state.used, state.reset_s)
        if state.used >= limit:
            raise self._refuse("cost_per_day_usd", f"today's budget of {limit:g} USD is spent", state.reset_s)

        async def settle(done: RequestContext) -> None:  # into the day the request was counted in
            if done.ledger.total_usd > 0:
                await counters.add(key, done.ledger.total_usd, DAY_S, state.window_start)

        ctx.finalizers.append(settle)

    async def _tokens(self, ctx: RequestContext, counters: Counters, key: str, limit: int, input_tokens: int,
                      want_output: int, report: dict[str, Any]) -> int:
        for _ in range(3):  # another request may take tokens between the read and the reservation
            state = await counters.get(key, DAY_S)
            output = min(want_output, int(limit - state.used) - input_tokens)
            if output < 1:
                report["tokens"] = _entry(limit, limit - state.used, state.reset_s)
                raise self._refuse("tokens_per_day", f"today's budget of {limit} tokens has "
                                   f"{max(0, int(limit - state.used))} left, too few for this request's "
                                   f"{input_tokens} prompt tokens", state.reset_s)
            reserved = input_tokens + output
            # Shielded, and settled by a finalizer registered before waiting: a request cancelled while
            # the reservation is being written still gives back what it did not use.
            reservation = asyncio.ensure_future(counters.consume(key, reserved, limit, DAY_S))
            ctx.finalizers.append(_give_back(counters, key, reserved, reservation))
            state = await asyncio.shield(reservation)
            if state.allowed:
                report["tokens"] = _entry(limit, limit - state.used, state.reset_s)
                return output
        raise self._refuse("tokens_per_day", "the token budget is in heavy use; retry", 1.0)

    def _counters(self) -> Counters:
        if self.resources.counters is None:
            raise BackendError(f"policy {self.stage_id!r} sets limits, but this process has no counter store")
        return self.resources.counters

    def _refuse(self, rule: str, message: str, reset_s: float) -> RateLimited:
        error = RateLimited(f"refused by policy {self.stage_id!r}: {message}", rule=f"limits.{rule}",
                            retry_after_s=max(1.0, math.ceil(reset_s)))
        error.policy = self.stage_id
        return error


def _give_back(counters: Counters, key: str, reserved: int, reservation: asyncio.Future[Any]) -> Any:
    async def settle(ctx: RequestContext) -> None:
        state = await reservation
        used = ctx.usage.input_tokens + ctx.usage.output_tokens
        if state.allowed and used != reserved:  # into the day of the reservation, even past midnight
            await counters.add(key, used - reserved, DAY_S, state.window_start)

    return settle


def _entry(limit: float, remaining: float, reset_s: float) -> dict[str, float]:
    return {"limit": limit, "remaining": max(0.0, remaining), "reset_s": reset_s}
