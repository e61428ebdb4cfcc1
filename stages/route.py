"""The ``route`` stage: picks the model for a request, and says why.

YAML (every key optional; ``pipelines/routed.yaml`` shows each mode)::

    - id: pick
      type: route
      with:
        rules:                               # first match wins; the `when:` expression language
          - {when: "prompt_tokens > 1500", model: big, reason: long prompt}
          - {when: "tags.tier == 'gold'", model: big}
        split:                               # weighted A/B or canary
          - {model: smol, weight: 90}
          - {model: canary, weight: 10}
        sticky: true                         # the same caller always lands on the same arm
        balance: [smol, smol-eu]             # equivalent models: the least busy one
        balance_by: waiting                  # waiting (queue, then running) | ttft (recent time to first token)
        default: smol                        # else the server's first model
        fallback: [remote]                   # tried in order when the chosen one fails, times out or is full
        retries: 1                           # extra attempts on the same model first
        cooldown_s: 30                       # a failing model is left out for this long
        first_token_timeout_s: 20            # a model silent this long counts as failed
        context_check: true                  # a prompt too long for the chosen model goes to one it fits

Order: rules, then split, then balance, then default. Writes ``model`` (and
``prompt_tokens``, counted with the default model's tokenizer, when a rule or
the context check needs it) and ``route_plan`` for ``generate``. The decision
(model, mode, reason) goes to the trace and the audit record's ``route``;
``generate`` adds the fallbacks it tried.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from functools import cached_property
from typing import Literal, cast

from pydantic import BaseModel, Field, PositiveFloat

from pipeline.context import EXPRESSION_TYPES, FIELDS, RequestContext, RoutePlan, chat_turns
from pipeline.errors import ExpressionError, InvalidInput
from pipeline.expr import Expression
from pipeline.expr import parse as parse_expression
from pipeline.protocols import Catalog
from pipeline.refs import ModelRef
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from stages.engines import engine_for


class Rule(NoConfig):
    #: An expression over context fields, e.g. ``prompt_tokens > 1500``.
    when: str
    #: The model a matching request goes to.
    model: ModelRef
    #: Recorded with the decision.
    reason: str = ""

    @cached_property
    def expression(self) -> Expression:
        return parse_expression(self.when, EXPRESSION_TYPES)


class Arm(NoConfig):
    #: The arm's model.
    model: ModelRef
    #: Its share of requests, relative to the other arms' weights.
    weight: PositiveFloat


class RouteConfig(NoConfig):
    #: The first rule whose ``when`` holds picks the model.
    rules: list[Rule] = Field(default_factory=list)
    #: Weighted A/B or canary: each request goes to an arm by weight.
    split: list[Arm] = Field(default_factory=list)
    #: split: the same caller always gets the same arm.
    sticky: bool = False
    #: Equivalent models: the least busy one is picked.
    balance: list[ModelRef] = Field(default_factory=list)
    #: balance: waiting (queue, then running) or ttft (recent time to first token).
    balance_by: Literal["waiting", "ttft"] = "waiting"
    #: The model when no rule, split or balance applies (default: the server's first model).
    default: ModelRef | None = None
    #: Models tried in order when the chosen one fails, times out or is full.
    fallback: list[ModelRef] = Field(default_factory=list)
    #: Extra attempts on the same model before falling back.
    retries: int = Field(0, ge=0, le=5)
    #: A failing model is left out for this long.
    cooldown_s: float = Field(30.0, ge=0)
    #: A model silent this long counts as failed.
    first_token_timeout_s: PositiveFloat | None = None
    #: A prompt too long for the chosen model goes to one it fits (else it is refused).
    context_check: bool = True
    #: Output tokens a model's window must have room for, on top of the prompt.
    reserve_output_tokens: int = Field(256, ge=0)

    def models(self) -> list[str]:
        named = [r.model for r in self.rules] + [a.model for a in self.split] + self.balance + self.fallback
        return list(dict.fromkeys([*named, *([self.default] if self.default else [])]))


class RouteStage(Stage):
    type_name = "route"
    Config = RouteConfig
    reads = frozenset({"input_messages"})
    writes = frozenset({"model", "route_plan", "prompt_tokens"})
    before = frozenset({"generate"})

    @classmethod
    def model_retries(cls, config: BaseModel) -> int:
        return cast(RouteConfig, config).retries

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        names: set[str] = set()
        for rule in cast(RouteConfig, config).rules:
            with contextlib.suppress(ExpressionError):  # reported by check()
                names |= rule.expression.names
        return cls.reads | (names & FIELDS.keys()) - {"prompt_tokens", "model"}

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        issues: list[CheckIssue] = []
        for i, rule in enumerate(cast(RouteConfig, config).rules):
            try:
                parse_expression(rule.when, EXPRESSION_TYPES)  # names and types, as rule.expression parses it
            except ExpressionError as exc:
                issues.append((("rules", i, "when"), f"bad expression: {exc}", exc.col))
        return issues

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(RouteConfig, self.config)
        if self._needs_tokens(config):
            await self._count(ctx)
        model, mode, reason = self._choose(ctx, config)
        model, mode, reason = self._fit(ctx, config, model, mode, reason)
        ctx.model = model
        ctx.route_plan = RoutePlan([m for m in config.fallback if m != model], config.retries, config.cooldown_s,
                                   config.first_token_timeout_s)
        ctx.facts["route"] = {"model": model, "mode": mode, "reason": reason, "fallbacks": ctx.route_plan.fallbacks}
        ctx.facts.setdefault("decisions", {})[self.id] = {"model": model, "mode": mode, "reason": reason}
        scope.set_attribute("inferline.route.model", model)
        scope.set_attribute("inferline.route.mode", mode)
        scope.set_attribute("inferline.route.reason", reason)

    def _choose(self, ctx: RequestContext, config: RouteConfig) -> tuple[str, str, str]:
        for index, rule in enumerate(config.rules):
            try:
                matched = rule.expression.evaluate(ctx.field_value)
            except ExpressionError as exc:  # e.g. a client tag that is not a number: the rule does not apply
                ctx.facts.setdefault("route_rule_errors", []).append(f"rules[{index}]: {exc}")
                continue
            if matched:
                return rule.model, "rule", rule.reason or f"rules[{index}]: {rule.when}"
        if config.split:
            return self._split(ctx, config)
        if config.balance:
            return self._balance(config)
        default = config.default or (self.resources.engines.default_model if self.resources.engines else "")
        return default, "default", "no rule matched" if config.rules else "default model"

    def _split(self, ctx: RequestContext, config: RouteConfig) -> tuple[str, str, str]:
        total = sum(arm.weight for arm in config.split)
        caller = ctx.principal.key_id if ctx.principal else ctx.client_addr
        if config.sticky and caller:  # a stable point in [0, 1) per caller and pipeline
            digest = hashlib.sha256(f"{ctx.pipeline}:{caller}".encode()).digest()
            point, how = int.from_bytes(digest[:8], "big") / 2**64 * total, "sticky"
        else:
            point, how = random.random() * total, "random"
        for arm in config.split:
            point -= arm.weight
            if point < 0:
                return arm.model, "split", f"{arm.weight / total:.0%} arm ({how})"
        return config.split[-1].model, "split", f"{config.split[-1].weight / total:.0%} arm ({how})"

    def _balance(self, config: RouteConfig) -> tuple[str, str, str]:
        engines = self.resources.engines
        loads = {m: engines.occupancy(m) for m in config.balance} if engines and hasattr(engines, "occupancy") else {}
        if not loads:
            return config.balance[0], "balance", "no load figures"
        if config.balance_by == "ttft":
            # A model never measured counts as fastest, so that it gets measured (else it would starve).
            ttft = {m: load.ttft_s or 0.0 for m, load in loads.items()}
            best = min(ttft, key=lambda m: (ttft[m], loads[m].waiting + loads[m].running))
            return best, "balance", f"lowest recent ttft ({ttft[best] * 1e3:.0f} ms)"
        best = min(loads, key=lambda m: (loads[m].waiting, loads[m].running))
        return best, "balance", f"fewest waiting ({loads[best].waiting} waiting, {loads[best].running} running)"

    def _fit(self, ctx: RequestContext, config: RouteConfig, model: str, mode: str,
             reason: str) -> tuple[str, str, str]:
        """The chosen model, or one of this route's models whose context window fits the prompt."""
        if not config.context_check or not ctx.prompt_tokens:
            return model, mode, reason
        need = ctx.prompt_tokens + config.reserve_output_tokens
        window = self._window(model)
        if window is None or need <= window:
            return model, mode, reason
        for other in [m for m in [*config.fallback, *config.models()] if m != model]:
            other_window = self._window(other)
            if other_window is None or need <= other_window:
                return other, "context", f"{ctx.prompt_tokens} prompt tokens do not fit {model!r} ({window})"
        raise InvalidInput(f"the prompt has {ctx.prompt_tokens} tokens (+{config.reserve_output_tokens} for the "
                           f"answer); no model this route may use has a large enough context window")

    def _window(self, model: str) -> int | None:
        info = self.resources.catalog.models.get(model)
        return info.context_window if info else None

    def _needs_tokens(self, config: RouteConfig) -> bool:
        uses = any("prompt_tokens" in r.expression.names for r in config.rules)
        windows = config.context_check and any(self._window(m) for m in config.models())
        return uses or bool(windows)

    async def _count(self, ctx: RequestContext) -> None:
        _, engine = await engine_for(self.resources, "")
        messages = ctx.messages or ctx.input_messages
        ctx.prompt_tokens = len(engine.tokenizer.encode_chat(chat_turns(messages)))
