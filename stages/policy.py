"""The ``policy`` stage: who may ask what, within which limits, and what may come back.

YAML (every key optional; see ``pipelines/guarded.yaml`` for each rail)::

    - id: guard
      type: policy
      with:
        roles: [caller]              # who may call, beyond the pipeline's access.roles
        keys: [Ab3dEf6hIj9k]         # only these API key ids (omit: any key)
        max_input_tokens: 2048       # longer prompts are refused (400)
        max_output_tokens: 256       # generation is capped here
        limits: {requests_per_minute: 60, tokens_per_day: 200000, cost_per_day_usd: 5, per: key}
        pii: {action: redact, restore: true}   # or just `pii: redact`; block | redact | flag | allow
        deny:
          - credentials              # a built-in rule set, or a rule of your own:
          - {id: competitors, category: business, keywords: [acme corp], action: flag}
          - {id: weapons, category: safety, regex: ['\\bbuild (a|an) (bomb|gun)\\b'], message: "Not here."}
        injection: {action: block, threshold: 0.5}
        classifier: {model: smol, action: flag, threshold: 0.5}  # a guard model (see stages/classifier.py)
        output: {pii: redact, deny: true, hold_back_chars: 48}   # output rails, applied by `stream`

Limits are counted before any prefill (see :mod:`stages.limits`); the input
rails scan every message the client sent (injection: user messages only) and
may redact them in place; the output rails are handed to the ``stream`` stage
as ``output_filter``. Every rule that fires is recorded in ``ctx.facts["policy"]``
(trace and audit); a refusal says which policy and rule refused, never the
offending text.
"""

from __future__ import annotations

import re
import re._parser as re_parser  # bounds how much text a deny pattern can match (Python 3.11+)
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any, Literal, cast

from pydantic import BaseModel, Field, PositiveInt, field_validator

from pipeline.context import ChatMessage, RequestContext, chat_turns
from pipeline.errors import InvalidInput, PolicyDenied
from pipeline.protocols import Catalog
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from stages.classifier import ClassifierConfig, GuardClassifier
from stages.detectors import PII_TYPES, PLACEHOLDER, DenyMatcher, DenyRule, Finding, Redactor, injection_score
from stages.engines import engine_for
from stages.limits import Limits, LimitsConfig
from stages.rails import Action, Decision, Detectors, OutputRails, non_overlapping, pii_actions, strongest

PiiType = Literal["email", "phone", "card", "iban", "ssn", "ip", "secret"]


class PiiConfig(NoConfig):
    #: What happens to personal data found: block the request, redact it, flag it, or allow it.
    action: Action = "redact"
    #: The kinds of personal data looked for.
    types: list[PiiType] = Field(default_factory=lambda: list(PII_TYPES))
    #: Actions for particular types, e.g. ``{card: block}``.
    per_type: dict[PiiType, Action] = Field(default_factory=dict)
    #: Put the caller's own redacted values back into the answer (placeholders the model repeats).
    restore: bool = False


def _shorthand(value: Any) -> Any:
    return {"action": value} if isinstance(value, str) else value


class DenyRuleConfig(NoConfig):
    #: The rule's name, recorded when it fires.
    id: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    #: Recorded with the decision (security, safety, business...).
    category: str = "denied"
    #: Told to the client when the rule blocks (never the matched text).
    message: str = ""
    #: Phrases that trigger the rule (case-insensitive).
    keywords: list[str] = Field(default_factory=list)
    #: Regular expressions that trigger the rule (case-insensitive).
    regex: list[str] = Field(default_factory=list)
    #: What happens when it fires: block, redact, flag or allow.
    action: Action = "block"

    def rule(self) -> DenyRule:
        return DenyRule(self.id, self.category, self.message, tuple(self.keywords), tuple(self.regex))


#: Rule sets a pipeline may name in ``deny:`` by name.
BUILTIN_DENY = {
    "credentials": DenyRuleConfig(
        id="credentials", category="security", message="Requests for other people's credentials are refused.",
        keywords=["dump credentials", "credential dump", "steal passwords", "steal credentials",
                  "password dump", "credential stuffing"],
        regex=[r"\b(?:give|send|tell|show|share)\s{1,3}me\s{1,3}(?:your|the|their|his|her)\s{1,3}"
               r"(?:admin\s{1,3})?(?:password|passwords|api\s{0,3}key|credentials|private\s{1,3}key)\b"]),
    "malware": DenyRuleConfig(
        id="malware", category="security", message="Help with malware is refused.",
        keywords=["ransomware", "keylogger", "botnet"],
        regex=[r"\b(?:write|build|create|make)\s{1,3}(?:a|an|some)?\s{0,3}(?:virus|worm|trojan|rootkit)\b"]),
}


class InjectionConfig(NoConfig):
    #: What happens to a likely prompt injection: block, redact, flag or allow.
    action: Action = "block"
    #: The combined heuristic score (0..1) at or above which the action applies.
    threshold: float = Field(0.5, ge=0, le=1)


class OutputConfig(NoConfig):
    #: What happens to personal data in the answer: block, redact, flag or allow.
    pii: Action = "redact"
    #: Apply the input's deny rules to the output too.
    deny: bool = True
    #: Characters held back while streaming so that nothing to block or redact is sent early.
    hold_back_chars: int = Field(48, ge=8, le=4096)


class PolicyConfig(NoConfig):
    #: Only keys of these roles may call (admins always may), beyond the pipeline's ``access.roles``.
    roles: list[str] | None = None
    #: Only these API key ids may call (default: any key).
    keys: list[str] | None = None
    #: Longer prompts are refused (400).
    max_input_tokens: PositiveInt | None = None
    #: Generation is capped here.
    max_output_tokens: PositiveInt | None = None
    #: Rate limits and budgets, counted before any prefill.
    limits: LimitsConfig | None = None
    #: Input rail: personal data in the messages; an action alone (``pii: redact``) or its options.
    pii: PiiConfig | None = None
    #: Input rails: built-in rule sets by name (credentials, malware) or rules of your own.
    deny: list[DenyRuleConfig | str] = Field(default_factory=list)
    #: Input rail: prompt-injection heuristics; an action alone (``injection: block``) or its options.
    injection: InjectionConfig | None = None
    #: Input rail: a guard model that scores each user message.
    classifier: ClassifierConfig | None = None
    #: Output rails, applied by the ``stream`` stage.
    output: OutputConfig | None = None

    # The shorthands are part of the schema editors check (``inferline schema pipeline``), not only accepted.
    _pii = field_validator("pii", mode="before", json_schema_input_type=PiiConfig | Action | None)(_shorthand)
    _injection = field_validator("injection", mode="before",
                                 json_schema_input_type=InjectionConfig | Action | None)(_shorthand)

    def deny_rules(self) -> list[DenyRuleConfig]:
        return [BUILTIN_DENY[r] if isinstance(r, str) else r for r in self.deny if not isinstance(r, str)
                or r in BUILTIN_DENY]


class PolicyStage(Stage):
    type_name = "policy"
    Config = PolicyConfig
    reads = frozenset({"input_messages"})
    writes = frozenset({"input_messages", "max_output_tokens", "output_filter"})
    # Limits before any prefill; output rails for the stream.
    before = frozenset({"generate", "stream", "llm", "pipeline", "agent"})

    def __init__(self, stage_id: str, config: BaseModel, resources: Any):
        super().__init__(stage_id, config, resources)
        c = cast(PolicyConfig, config)
        rules = c.deny_rules()
        matcher = DenyMatcher([r.rule() for r in rules]) if rules else None
        actions = {r.id: r.action for r in rules}
        pii = c.pii
        self._input = Detectors(pii_actions(pii.action, pii.per_type, pii.types) if pii else {}, matcher, actions)
        out = c.output
        self._output = None if out is None else Detectors(
            pii_actions(out.pii, {}), matcher if out.deny else None, actions)
        self._hold_back = 0 if out is None else max(out.hold_back_chars, longest_match(c) if out.deny else 0,
                                                    PII_MAX_CHARS if self._output and self._output.pii_actions else 0)
        self._limits = None if c.limits is None else Limits(stage_id, c.limits, resources)
        self._classifier = None if c.classifier is None else GuardClassifier(c.classifier)

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        c = cast(PolicyConfig, config)
        issues: list[CheckIssue] = []
        seen: set[str] = set()
        on_output = c.output is not None and c.output.deny
        for i, rule in enumerate(c.deny):
            if isinstance(rule, str) and rule not in BUILTIN_DENY:
                issues.append((("deny", i), f"no built-in rule set {rule!r}; built in: "
                                            f"{', '.join(sorted(BUILTIN_DENY))}, or write a rule "
                                            "{id: ..., keywords: [...], regex: [...]}"))
                continue
            rule = BUILTIN_DENY[rule] if isinstance(rule, str) else rule
            if rule.id in seen:
                issues.append((("deny", i), f"rule id {rule.id!r} is used twice; ids name rules in decisions"))
            seen.add(rule.id)
            issues += _check_rule(rule, ("deny", i), on_output)
        if c.pii is not None and c.pii.restore and (c.output is None):
            issues.append((("pii", "restore"), "restore puts values back in the answer as it streams, which "
                                               "the output rails do: add `output:` (e.g. output: {pii: redact})"))
        return issues

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(PolicyConfig, self.config)
        decisions: list[Decision] = []
        try:
            self._access(ctx, config, decisions)
            input_tokens = await self._count_tokens(ctx, config, decisions)
            cap = _smaller(ctx.max_output_tokens, config.max_output_tokens)  # an earlier policy's cap holds
            if self._limits is not None:
                cap = await self._limits.enforce(ctx, input_tokens, cap)
            ctx.max_output_tokens = cap
            pii_map, placeholders = self._input_rails(ctx, config, decisions)
            if self._classifier is not None:
                await self._classify(ctx, scope, decisions)
            restore = pii_map if config.pii and config.pii.restore and pii_map else None
            ctx.facts["input_rails"] = lambda text, source: self.scan_untrusted(ctx, text, source)
            rails = self.output_rails(restore, ctx.facts.setdefault("policy", []).append, placeholders)
            if rails is not None:
                ctx.output_filter = rails
        except PolicyDenied as exc:
            if not any(d.action == "block" for d in decisions):  # refused by access or limits, not a rail
                decisions.append(Decision(self.id, "input", exc.rule, exc.category, "block", 1.0, ()))
            raise
        finally:
            self._record(ctx, scope, decisions)

    def scan_untrusted(self, ctx: RequestContext, text: str, source: str) -> str:
        """*text* from outside the request (an agent step's tool result, *source* ``tool:NAME``) through the
        input rails: deny rules, PII and the injection heuristic (whatever role would carry it). Decisions are
        recorded as the input's are; returns the text redacted as they say; PolicyDenied on a block."""
        config = cast(PolicyConfig, self.config)
        found: list[tuple[Finding, Action]] = self._input.scan(text) if self._input.active else []
        if config.injection is not None:
            result = injection_score(text)
            if result.score >= config.injection.threshold:
                found += [(f, config.injection.action) for f in result.findings]
        decisions = [Decision(self.id, source, f.rule, f.category, a, f.score, (f.start, f.end))
                     for f, a in found if a != "allow"]
        ctx.facts.setdefault("policy", []).extend(d.to_dict() for d in decisions)
        block = next((d for d in decisions if d.action == "block"), None)
        if block is not None:
            raise self._deny(block.rule, block.category, f"the {block.category} rule {block.rule!r} matched {source}")
        redact = [f if f.category == "pii" else replace(f, kind="REDACTED")
                  for f in non_overlapping([f for f, a in found if a == "redact"])]
        return Redactor().redact(text, redact) if redact else text

    def output_rails(self, restore: dict[str, str] | None = None,
                     on_decision: Callable[[dict[str, Any]], None] | None = None,
                     taken: Collection[str] = ()) -> OutputRails | None:
        """Fresh output rails for one request (None when this policy has no ``output:``). The hold-back is
        at least the longest text a rule can match, so that no match is ever sent in part."""
        if self._output is None:
            return None
        return OutputRails(self.id, self._output, self._hold_back, restore, on_decision, taken)

    def _access(self, ctx: RequestContext, config: PolicyConfig, decisions: list[Decision]) -> None:
        principal = ctx.principal
        if principal is None:  # auth is off (loopback only): everyone is allowed, as in the HTTP layer
            return
        if config.roles is not None and principal.role not in config.roles and principal.role != "admin":
            raise self._deny("access.roles", "access", f"role {principal.role!r} may not use this pipeline")
        if config.keys is not None and principal.key_id not in config.keys:
            raise self._deny("access.keys", "access", "this API key may not use this pipeline")

    async def _count_tokens(self, ctx: RequestContext, config: PolicyConfig, decisions: list[Decision]) -> int:
        if config.max_input_tokens is None and not (self._limits and self._limits.config.counts_tokens):
            return 0
        _, engine = await engine_for(self.resources, ctx.model)
        count = len(engine.tokenizer.encode_chat(chat_turns(ctx.input_messages)))
        limit = config.max_input_tokens
        if limit is not None and count > limit:
            decisions.append(Decision(self.id, "input", "limits.max_input_tokens", "limits", "block", 1.0, ()))
            raise InvalidInput(f"refused by policy {self.id!r}: the input has {count} tokens, over the limit "
                               f"of {limit}")
        return count

    def _input_rails(self, ctx: RequestContext, config: PolicyConfig,
                     decisions: list[Decision]) -> tuple[dict[str, str], list[str]]:
        """Scan, record and redact the client's messages; raise on a block. Returns the PII placeholders
        with their values, and every placeholder used."""
        redactor = Redactor()
        messages: list[ChatMessage] = []
        injection_top = 0.0
        for index, message in enumerate(ctx.input_messages):
            found: list[tuple[Finding, Action]] = self._input.scan(message.content) if self._input.active else []
            if config.injection is not None and message.role == "user":
                result = injection_score(message.content)
                injection_top = max(injection_top, result.score)
                if result.score >= config.injection.threshold:
                    found += [(f, config.injection.action) for f in result.findings]
            decisions += [Decision(self.id, "input", f.rule, f.category, a, f.score, (index, f.start, f.end))
                          for f, a in found if a != "allow"]
            # Only PII placeholders keep their type (and may be restored); others are <REDACTED_n>.
            redact = [f if f.category == "pii" else replace(f, kind="REDACTED")
                      for f in non_overlapping([f for f, a in found if a == "redact"])]
            messages.append(ChatMessage(message.role, redactor.redact(message.content, redact) if redact
                                        else message.content))
        if injection_top:
            ctx.facts.setdefault("decisions", {}).setdefault(self.id, {})["injection_score"] = round(injection_top, 4)
        block = next((d for d in decisions if d.action == "block"), None)
        if block is not None:
            rule = next((r for r in config.deny_rules() if f"deny.{r.id}" == block.rule), None)
            raise self._deny(block.rule, block.category, rule.message if rule and rule.message else
                             f"the {block.category} rule {block.rule!r} matched the input")
        changed = messages != ctx.input_messages
        if changed:
            ctx.facts["original_input"] = ctx.input
            ctx.facts["original_messages"] = ctx.input_messages
            ctx.input_messages = messages
        if changed or "redact" in self._input.pii_actions.values():
            ctx.facts["redacted_input"] = ctx.input
        mapping = redactor.mapping
        return ({placeholder: value for placeholder, value in mapping.items()
                 if (m := PLACEHOLDER.fullmatch(placeholder)) and m.group(1).lower() in PII_TYPES}, list(mapping))

    async def _classify(self, ctx: RequestContext, scope: StageScope, decisions: list[Decision]) -> None:
        classifier = cast(GuardClassifier, self._classifier)
        config = classifier.config
        verdict = await classifier.classify(self.resources, ctx.input, cache_salt=ctx.tenant)
        info = self.resources.catalog.models.get(config.model)
        if info is not None:
            scope.add_cost(info.price.tokens_usd(verdict.input_tokens, verdict.output_tokens), "tokens",
                           f"guard {config.model}: {verdict.input_tokens} in, {verdict.output_tokens} out")
        ctx.facts.setdefault("decisions", {}).setdefault(self.id, {})["classifier"] = {
            "model": config.model, "verdict": verdict.verdict, "score": round(verdict.score, 4),
            "category": verdict.category}
        if verdict.score < config.threshold or config.action == "allow":
            return
        last_user = max((i for i, m in enumerate(ctx.input_messages) if m.role == "user"), default=0)
        decisions.append(Decision(self.id, "input", f"classifier.{config.model}", verdict.category or "unsafe",
                                  config.action, verdict.score, (last_user, 0, len(ctx.input))))
        if config.action == "block":
            raise self._deny(f"classifier.{config.model}", verdict.category or "unsafe",
                             f"the guard model judged the input unsafe ({verdict.category or 'unsafe'})")

    def _deny(self, rule: str, category: str, message: str) -> PolicyDenied:
        return PolicyDenied(f"refused by policy {self.id!r}: {message}", rule=rule, category=category,
                            policy=self.id)

    def _record(self, ctx: RequestContext, scope: StageScope, decisions: list[Decision]) -> None:
        records = [d.to_dict() for d in decisions]
        ctx.facts.setdefault("policy", []).extend(records)
        summary = ctx.facts.setdefault("decisions", {}).setdefault(self.id, {})
        summary.update({"action": strongest([d.action for d in decisions]),
                        "rules": sorted({d.rule for d in decisions})})
        if "limits" in ctx.facts:
            summary["limits"] = ctx.facts["limits"]
        for record in records:
            scope.add_event("inferline.policy.decision", {k: v for k, v in record.items() if k != "span"})
        scope.set_attribute("inferline.policy.action", summary["action"])




#: The longest text a PII detector matches that output rails must see whole (an IBAN with spaces: 42).
PII_MAX_CHARS = 48


def longest_match(config: PolicyConfig) -> int:
    """The longest text any deny rule can match (keywords and bounded regexes)."""
    longest = 0
    for rule in config.deny_rules():
        longest = max([longest, *(len(k) + 8 for k in rule.keywords)])
        for pattern in rule.regex:
            width = _max_width(pattern)
            if width is not None:
                longest = max(longest, width)
    return longest


def _max_width(pattern: str) -> int | None:
    """The most characters *pattern* can match; None if unbounded or invalid."""
    try:
        width = re_parser.parse(pattern).getwidth()[1]
    except re.error:
        return None
    return None if width >= re_parser.MAXREPEAT else int(width)


def _check_rule(rule: DenyRuleConfig, loc: tuple[str | int, ...], on_output: bool) -> list[CheckIssue]:
    issues: list[CheckIssue] = []
    for j, pattern in enumerate(rule.regex):
        try:
            re.compile(pattern)
        except re.error as exc:
            issues.append(((*loc, "regex", j), f"invalid regular expression: {exc}"))
            continue
        if on_output and _max_width(pattern) is None:
            issues.append(((*loc, "regex", j), "this pattern can match text of any length, so the output rails "
                                               "cannot hold back enough to stop it before it is sent: bound it "
                                               r"(\s{1,3} instead of \s+) or set output.deny: false"))
    for j, keyword in enumerate(rule.keywords):
        if not keyword.strip():
            issues.append(((*loc, "keywords", j), "an empty keyword matches nothing"))
    if not rule.keywords and not rule.regex:
        issues.append((loc, f"rule {rule.id!r} has neither keywords nor regex"))
    return issues


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
