"""The ``stream`` stage: token ids to text for the client, as they come.

YAML::

    - id: out
      type: stream
      with:
        stop: ["\\n\\nUser:"]     # stop strings, matched across chunk boundaries
        retry_invalid: 2         # with generate's output: and a backend that may not enforce it

Detokenizes incrementally (a delta never splits a multi-byte character),
applies stop strings, its own and the client's (they are not sent), runs the
policy stage's output rails when there is one (``output_filter``: held-back
text, redaction, and a block that stops generation with finish reason
``content_filter``), sends text deltas to the client, and records usage,
finish reason and cost. When ``generate`` constrained the output
(``output:``), the final text is checked against the constraint and the
result recorded: trace attribute ``inferline.output.valid``, and the stage's
decision in the audit record (``{"output_valid": ..., "error": ...}``). The cost is the model's token
prices plus its compute price for the time spent generating. Leaving early
(a stop string, a client disconnect) aborts the request in the engine.

With ``n`` above 1 (generate's sampling) the events of the ``n`` answers come interleaved, each with its
``index``: each answer has its own detokenizer and stop strings, its deltas go out with its index, and
``ctx.choices`` keeps every answer (``output_text`` is choice 0's, the usage counts all of their tokens).
An answer ended by a stop string sends nothing more (the engine finishes its sequence at ``max_tokens``;
its later tokens are not counted). ``retry_invalid`` does not apply, and generate refuses ``n`` above 1
under output rails.

With ``logprobs`` asked for (generate's sampling), each token's log-probability (and the likeliest
tokens', by their own text) goes to ``ctx.logprobs`` (or its choice's) and out with the delta its text
came in; tokens that made no text yet ride with a later delta, or an empty one at the end. Tokens a
constraint forced (no sample, no log-probability) have none.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, cast

import jsonschema
from pydantic import Field

from pipeline.context import Choice, RequestContext, TokenLogprob, Usage
from pipeline.protocols import TextFilter, TokenEvent, TokenStream
from pipeline.stage import NoConfig, Stage, StageScope
from pipeline.tracing import GEN_AI_RESPONSE_FINISH_REASONS, GEN_AI_USAGE_INPUT_TOKENS, GEN_AI_USAGE_OUTPUT_TOKENS
from stages.engines import engine_for
from stages.failover import submit_with_fallback
from stages.rails import strongest
from stages.text import IncrementalDetokenizer, StopStrings

logger = logging.getLogger(__name__)


class StreamConfig(NoConfig):
    #: Stop strings, matched across chunks (they are not sent).
    stop: list[str] = Field(default_factory=list)
    #: With generate's ``output:``, generate again up to this many times when a complete answer does not
    #: match (for backends that do not enforce the constraint: a remote server may ignore it). The text is
    #: then held back until it is checked, so the client gets it in one piece.
    retry_invalid: int = Field(0, ge=0, le=5)


class StreamStage(Stage):
    type_name = "stream"
    Config = StreamConfig
    sends_answer = answers_chain = True
    reads = frozenset({"token_stream", "model"})
    writes = frozenset({"output_text", "output_ids", "finish_reason"})

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(StreamConfig, self.config)
        request = ctx.facts.get("generate_request")
        if request is not None and request[0].n > 1:
            await self._choices(ctx, scope, config, request[0].n)
            return
        retries = config.retry_invalid if "output_constraint" in ctx.facts else 0
        for attempt in range(retries + 1):
            held = attempt < retries  # another try may follow: nothing reaches the client until it is checked
            await self._once(ctx, scope, config, held)
            error = self._validate(ctx, scope) if "output_constraint" in ctx.facts else None
            if error is None or ctx.finish_reason != "stop" or not held:
                if held and (ctx.output_text or ctx.logprobs):
                    await scope.emit_text(ctx.output_text, 0, tuple(ctx.logprobs))  # held back until checked
                return
            scope.add_event("inferline.output.retry", {"attempt": attempt + 1, "error": error})
            sampling, salt = ctx.facts["generate_request"]
            ctx.model, _, ctx.token_stream = await submit_with_fallback(self.resources, ctx, sampling, salt)
            ctx.output_ids, ctx.logprobs = [], []

    async def _once(self, ctx: RequestContext, scope: StageScope, config: StreamConfig, held: bool) -> None:
        stream = cast(TokenStream, ctx.token_stream)
        _, engine = await engine_for(self.resources, ctx.model)
        detokenizer = IncrementalDetokenizer(engine.tokenizer.decode, ctx.prompt_ids)
        stops = StopStrings([*config.stop, *ctx.stop])
        started = time.perf_counter()
        try:
            ctx.finish_reason = await _pump(stream, detokenizer, stops, ctx, scope, held,
                                            _reader(engine.tokenizer.decode, ctx))
            if stops.matched is not None:
                ctx.facts["stop_sequence"] = stops.matched
            else:
                ctx.facts.pop("stop_sequence", None)  # a retry's own stop, or none
        finally:
            await stream.aclose()
            self._account(ctx, scope, time.perf_counter() - started)
            self._record_rails(ctx, scope)

    async def _choices(self, ctx: RequestContext, scope: StageScope, config: StreamConfig, n: int) -> None:
        """Send the ``n`` interleaved answers of one stream, each under its index; keep them in ``ctx.choices``."""
        stream = cast(TokenStream, ctx.token_stream)
        _, engine = await engine_for(self.resources, ctx.model)
        answers = [_Answer(IncrementalDetokenizer(engine.tokenizer.decode, ctx.prompt_ids),
                           StopStrings([*config.stop, *ctx.stop])) for _ in range(n)]
        read_logprob = _reader(engine.tokenizer.decode, ctx)
        started = time.perf_counter()
        try:
            async for event in stream:
                index = getattr(event, "index", 0)
                answer = answers[index]
                if answer.finish_reason:
                    continue  # ended by a stop string
                answer.num_tokens = event.num_output_tokens
                ctx.usage = Usage(event.num_prompt_tokens, sum(a.num_tokens for a in answers))
                text = answer.feed(event)
                logprob = read_logprob(event) if read_logprob is not None else None
                if logprob is not None:
                    answer.logprobs.append(logprob)
                    answer.pending.append(logprob)
                if text:
                    answer.parts.append(text)
                if text or (answer.pending and answer.finish_reason):
                    await scope.emit_text(text, index, tuple(answer.pending))
                    answer.pending.clear()
        finally:
            await stream.aclose()
            ctx.choices = [Choice(i, "".join(a.parts), a.finish_reason, a.num_tokens, tuple(a.logprobs))
                           for i, a in enumerate(answers)]
            ctx.logprobs = answers[0].logprobs
            ctx.output_text, ctx.finish_reason, ctx.output_ids = ctx.choices[0].text, answers[0].finish_reason, \
                answers[0].ids
            self._account(ctx, scope, time.perf_counter() - started)
        if "output_constraint" in ctx.facts:
            self._validate_choices(ctx, scope)

    def _validate_choices(self, ctx: RequestContext, scope: StageScope) -> None:
        """Check every answer against ``generate``'s ``output`` constraint; record the first failure."""
        errors = [(c.index, check_output(c.text, ctx.facts["output_constraint"]) or (
            None if c.finish_reason == "stop" else f"incomplete: finish reason {c.finish_reason!r}"))
                  for c in ctx.choices]
        failed = [(index, error) for index, error in errors if error is not None]
        scope.set_attribute("inferline.output.valid", not failed)
        result = {"output_valid": not failed} | ({"error": f"choice {failed[0][0]}: {failed[0][1]}"} if failed else {})
        ctx.facts.setdefault("decisions", {}).setdefault(self.id, {}).update(result)

    def _validate(self, ctx: RequestContext, scope: StageScope) -> str | None:
        """Check the text against ``generate``'s ``output`` constraint; record the result in trace and audit.

        A local model decodes under the constraint, so a failure there is a bug to report (logged as an
        error), not something to repair; a remote backend may not enforce it. Text cut by ``max_tokens``
        or a stop string is incomplete and recorded as such.
        """
        error = check_output(ctx.output_text, ctx.facts["output_constraint"])
        if error is None and ctx.finish_reason != "stop":
            error = f"incomplete: generation ended with finish reason {ctx.finish_reason!r}"
        scope.set_attribute("inferline.output.valid", error is None)
        result = {"output_valid": error is None} | ({"error": error} if error else {})
        ctx.facts.setdefault("decisions", {}).setdefault(self.id, {}).update(result)
        if error is not None:
            scope.add_event("inferline.output.invalid", {"error": error})
            # Under a local engine's constrained decoding a complete output that fails is a bug to report.
            logger.warning("output of request %s does not match its constraint: %s", ctx.request_id, error)
        return error

    def _record_rails(self, ctx: RequestContext, scope: StageScope) -> None:
        if ctx.output_filter is None or not ctx.output_filter.decisions:
            return
        decisions = ctx.output_filter.decisions
        for decision in decisions:
            scope.add_event("inferline.policy.decision", {k: v for k, v in decision.items() if k != "span"})
        ctx.facts.setdefault("decisions", {})[self.id] = {"action": strongest([d["action"] for d in decisions]),
                                                          "rules": sorted({d["rule"] for d in decisions})}

    def _account(self, ctx: RequestContext, scope: StageScope, seconds: float) -> None:
        info = self.resources.catalog.models.get(ctx.model)
        if info is not None and not ctx.facts.get("cache", {}).get("hit"):  # a cached answer costs no model time
            price = info.price
            scope.add_cost(price.tokens_usd(ctx.usage.input_tokens, ctx.usage.output_tokens), "tokens",
                           f"{ctx.model}: {ctx.usage.input_tokens} in, {ctx.usage.output_tokens} out")
            scope.add_cost(price.compute_usd(seconds), "compute", f"{ctx.model}: {seconds:.3f} s")
        scope.add_tokens(ctx.usage.input_tokens, ctx.usage.output_tokens)
        scope.set_attribute(GEN_AI_USAGE_INPUT_TOKENS, ctx.usage.input_tokens)
        scope.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, ctx.usage.output_tokens)
        if ctx.finish_reason:
            scope.set_attribute(GEN_AI_RESPONSE_FINISH_REASONS, [ctx.finish_reason])


def check_output(text: str, constraint: dict[str, Any]) -> str | None:
    """Why *text* does not match *constraint* (``generate``'s ``output``), or None when it does."""
    (kind, value), = constraint.items()
    if kind == "choice":
        return None if text in value else f"not one of the {len(value)} choices"
    # A constraint the local engine compiles can still fail here: its regexes are Rust's syntax, not
    # Python's, and a backend that does not enforce constraints never compiled it. That is a finding
    # about the answer, recorded as such, not a failure of the request.
    if kind == "regex":
        try:
            return None if re.fullmatch(value, text, flags=re.DOTALL) else "does not match the regular expression"
        except (re.error, TypeError) as exc:
            return f"the regular expression cannot be checked here: {exc}"
    try:
        document = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(value).iter_errors(document))
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType, RecursionError) as exc:
        return f"the JSON Schema cannot be checked here: {str(exc).splitlines()[0]}"
    return None if error is None else f"schema: {error.message} at {'/'.join(map(str, error.absolute_path)) or '/'}"


class _Answer:
    """One of ``n`` answers on its way to the client: its own detokenizer, stop strings and text."""

    __slots__ = ("detokenizer", "finish_reason", "ids", "logprobs", "num_tokens", "parts", "pending", "stops")

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: StopStrings):
        self.detokenizer, self.stops = detokenizer, stops
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.pending: list[TokenLogprob] = []
        """Log-probabilities of tokens whose text has not gone out yet."""
        self.num_tokens = 0
        self.finish_reason = ""

    def feed(self, event: TokenEvent) -> str:
        """The text *event* adds; sets the finish reason when it ends the answer."""
        text, hit = self.stops.feed(_text_of(event, self.detokenizer, self.ids))
        if hit:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            tail, hit = self.stops.feed(self.detokenizer.flush())
            text += tail + ("" if hit else self.stops.flush())
            self.finish_reason = "stop" if hit else event.finish_reason
        return text


def _reader(decode: Any, ctx: RequestContext) -> Any:
    """Reads an event's log-probabilities as a :class:`TokenLogprob` (None for a token without any), or is
    None when the request did not ask for them."""
    request = ctx.facts.get("generate_request")
    if request is None or request[0].logprobs is None:
        return None

    def read(event: TokenEvent) -> TokenLogprob | None:
        logprob = getattr(event, "logprob", None)
        if logprob is None or event.token_id is None:
            return None
        top = tuple((decode([token_id]), value) for token_id, value in getattr(event, "top_logprobs", ()))
        return TokenLogprob(decode([event.token_id]), logprob, top)

    return read


class _Out:
    """Text on its way to the client, through the policy's output rails when there are any."""

    __slots__ = ("filter", "held", "parts", "pending", "scope")

    def __init__(self, text_filter: TextFilter | None, scope: StageScope, held: bool = False):
        self.filter, self.scope, self.held = text_filter, scope, held
        self.parts: list[str] = []
        self.pending: list[TokenLogprob] = []
        """Log-probabilities of tokens whose text has not gone out yet."""

    async def send(self, text: str, final: bool = False, logprob: TokenLogprob | None = None) -> str | None:
        """Send what the rails let through; a finish reason when they stop the stream."""
        reason = None
        if logprob is not None:
            self.pending.append(logprob)
        if self.filter is not None:
            text, reason = self.filter.feed(text)
            if final and reason is None:
                tail, reason = self.filter.flush()
                text += tail
        if text:
            self.parts.append(text)
        if not self.held and (text or (final and self.pending)):
            await self.scope.emit_text(text, 0, tuple(self.pending))
            self.pending.clear()
        return reason


def _text_of(event: TokenEvent, detokenizer: IncrementalDetokenizer, ids: list[int]) -> str:
    """The event's new text: a remote backend's own text, else our detokenizer's."""
    text = getattr(event, "text", None)
    if event.token_id is not None:
        ids.append(event.token_id)
        if text is None:
            return detokenizer.add(event.token_id)
    return text or ""


async def _pump(stream: TokenStream, detokenizer: IncrementalDetokenizer, stops: StopStrings,
                ctx: RequestContext, scope: StageScope, held: bool = False, read_logprob: Any = None) -> str:
    """Send text until the engine finishes, a stop string appears or a rail blocks; return the finish reason.

    *held*: collect the text without sending it (the caller sends it once it is checked).
    """
    out = _Out(ctx.output_filter, scope, held)
    finish = ""
    try:
        async for event in stream:
            ctx.usage = Usage(event.num_prompt_tokens, event.num_output_tokens)
            text, hit = stops.feed(_text_of(event, detokenizer, ctx.output_ids))
            logprob = read_logprob(event) if read_logprob is not None else None
            if logprob is not None:
                ctx.logprobs.append(logprob)
            if hit:
                return await out.send(text, final=True, logprob=logprob) or "stop"
            if blocked := await out.send(text, logprob=logprob):
                return blocked  # leaving aborts the request in the engine: generation stops
            if event.finish_reason is not None:
                finish = event.finish_reason
                break
        tail, hit = stops.feed(detokenizer.flush())
        tail += "" if hit else stops.flush()
        return await out.send(tail, final=True) or ("stop" if hit else finish)
    finally:
        # Joined once, here, so that a disconnect still leaves the partial text for the audit record.
        ctx.output_text = "".join(out.parts)
        if out.filter is not None:
            ctx.facts["redacted_output"] = out.filter.sent_redacted
