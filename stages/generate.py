"""The ``generate`` stage: submits the prompt to the model's engine.

YAML::

    - id: gen
      type: generate
      with:
        max_tokens: 256
        temperature: 0.7        # 0 = greedy
        top_p: 0.95
        seed: 7                 # same seed and prompt -> same output
        n: 1                    # answers per request (a caller's n, as client_params allows by default)
        client_params: [max_tokens, temperature, top_p, seed]   # what a caller may override
        isolate_tenants: true   # tenants never share prefix-cache blocks
        speculative: false      # opt out of the model's speculative decoding (default: on where configured)
        output:                 # constrained decoding: one of json_schema, regex, choice
          json_schema: {type: object, properties: {name: {type: string}}, required: [name]}
          caller_may_override: false   # the default: a caller's output/response_format is refused
        priority: interactive   # or batch: admitted after interactive work, never starved
        queue_timeout_ms: 2000  # still queued for the model after this long: 503 deadline_exceeded

Writes ``token_stream``; the ``stream`` stage consumes it and closes it. A
stream that no stage read to its end (a later stage failed, or the request was
cancelled before ``stream`` ran) is closed when the request ends: the engine
stops generating for it and it no longer counts as the model's load. With a
``route`` stage before it, failures fall back to the route's next models (see
:mod:`stages.failover`); a ``cache`` hit has already written ``token_stream``,
and then nothing is generated. A caller's
``params`` may override only the options listed in ``client_params``, and
``max_tokens`` never above this stage's own value, nor above a policy
stage's cap (``max_output_tokens``, or what its token budget reserved).

A pipeline's own ``output`` is its owner's contract: a caller's ``output``
(what the OpenAI API's ``response_format`` and a forced tool call become) may
replace it only where it says ``caller_may_override: true`` (and ``output`` is
in ``client_params``); otherwise the request is refused (400). A pipeline with
no ``output`` of its own takes the caller's as ``client_params`` allows.

Scheduling (local engines; a remote backend ignores it): ``priority`` is the
pipeline's class. When the model is busy, waiting ``interactive`` requests are
admitted first, but a waiting ``batch`` request is passed over at most 4 times
in a row. Within a class, tenants (the caller's API-key tenant) take turns, so
one tenant's burst cannot starve another's request. ``queue_timeout_ms`` bounds
the wait for admission (counted from this stage's start, fallbacks included):
a request still queued then is dropped before prefill and fails with
``deadline_exceeded`` (HTTP 503). Once started, a request is never dropped for
its deadline.
"""

from __future__ import annotations

import difflib
import time
from dataclasses import fields, replace
from typing import Any, Literal, cast

import jsonschema
from pydantic import BaseModel, Field, ValidationError, model_validator

from pipeline.context import RequestContext
from pipeline.errors import InvalidInput
from pipeline.protocols import Catalog, ChatEngine, Engine, SamplingParams, SchedulingHints, TokenStream
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.tracing import (
    GEN_AI_OPERATION_NAME,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_TOP_P,
    GEN_AI_RESPONSE_MODEL,
)
from stages.engines import engine_for
from stages.failover import submit_with_fallback

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


class OutputSpec(NoConfig):
    """What the output must be: exactly one of a JSON Schema, a regular expression, or one of fixed strings."""

    #: The output is JSON valid against this schema.
    json_schema: dict[str, Any] | None = None
    #: The output matches this regular expression.
    regex: str | None = None
    #: The output is exactly one of these strings.
    choice: list[str] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> OutputSpec:
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex or choice (got {given or 'none'})")
        return self

    def as_dict(self) -> dict[str, Any]:
        return {name: value for name, value in self.model_dump().items() if value is not None}


class PipelineOutput(OutputSpec):
    """A pipeline's own ``output``, and whether a caller's may replace it."""

    #: Let a caller's own ``output`` (or response_format) replace this one.
    caller_may_override: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {name: value for name, value in super().as_dict().items() if name != "caller_may_override"}


class Sampling(NoConfig):
    """Sampling options, validated both in YAML and in a caller's overrides."""

    #: The most tokens generated.
    max_tokens: int = Field(256, ge=1)
    #: Randomness of sampling; 0 is greedy (always the likeliest token).
    temperature: float = Field(1.0, ge=0)
    #: Sample from the smallest set of tokens whose probabilities add up to this (1: all).
    top_p: float = Field(1.0, gt=0, le=1)
    #: Sample from the k likeliest tokens (0: all).
    top_k: int = Field(0, ge=0)
    #: Leave out tokens less likely than this fraction of the likeliest one's probability (0: none).
    min_p: float = Field(0.0, ge=0, le=1)
    #: Above 1, tokens already in the prompt or output become less likely.
    repetition_penalty: float = Field(1.0, gt=0)
    #: Lowers the logits of tokens that already appeared in the output (OpenAI's).
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    #: Lowers the logits of tokens by how often they appeared in the output (OpenAI's).
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    #: Same seed and prompt, same output.
    seed: int | None = None
    #: Token ids that end generation (besides the model's end-of-sequence token).
    stop_token_ids: list[int] = Field(default_factory=list)
    #: Keep generating past the end-of-sequence token, up to ``max_tokens``.
    ignore_eos: bool = False
    #: No end-of-sequence or stop token before this many output tokens (at most ``max_tokens``).
    min_tokens: int = Field(0, ge=0)
    #: Return this many most likely tokens' log-probabilities with each token.
    logprobs: int | None = Field(None, ge=0, le=20)
    #: Let the model's speculative decoding (inferline.yaml) guess tokens: same output, only speed differs.
    speculative: bool = True
    #: Constrained decoding: the output is guaranteed to match (local models; see OutputSpec).
    output: OutputSpec | None = None
    #: How many answers to sample (local models): the prompt is prefilled once and the engine forks the
    #: others from it; ``max_tokens`` applies to each.
    n: int = Field(1, ge=1, le=16)


class GenerateConfig(Sampling):
    #: Constrained decoding: the output is guaranteed to match (local models).
    output: PipelineOutput | None = None
    #: The sampling options a caller's ``params`` may override (``max_tokens`` never above this stage's).
    client_params: list[str] = Field(
        default_factory=lambda: ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                                 "min_tokens", "logprobs", "output", "n"])
    #: Tenants never share prefix-cache blocks (one cannot time another's prompts).
    isolate_tenants: bool = False
    #: The pipeline's priority class: interactive is admitted before batch (batch is never starved).
    priority: Literal["interactive", "batch"] = "interactive"
    #: Longest wait for admission by the model; None: as long as it takes.
    queue_timeout_ms: int | None = Field(None, ge=1)


class GenerateStage(Stage):
    type_name = "generate"
    Config = GenerateConfig
    is_model_call = True
    reads = frozenset({"prompt_ids", "model"})
    writes = frozenset({"token_stream"})

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        config = cast(GenerateConfig, config)
        unknown = sorted(set(config.client_params) - _SAMPLING_FIELDS)
        issues: list[CheckIssue] = [(("client_params",), f"unknown sampling options {unknown}; known: "
                                                         f"{sorted(_SAMPLING_FIELDS)}")] if unknown else []
        if config.output is not None:
            issues += output_issues(config.output, catalog)
        return issues + _override_issues(config)

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(GenerateConfig, self.config)
        sampling = _sampling(config, ctx.params)
        if ctx.max_output_tokens is not None and sampling.max_tokens > ctx.max_output_tokens:
            sampling = replace(sampling, max_tokens=ctx.max_output_tokens)  # a policy's cap or token budget
        if sampling.n > 1 and ctx.output_filter is not None:
            raise InvalidInput(f"n: this pipeline's output rails check one answer at a time, and this request asks "
                               f"for {sampling.n}; send n: 1")
        if sampling.logprobs is not None and ctx.output_filter is not None:
            raise InvalidInput("logprobs: this pipeline's output rails may hold back or redact text, which the "
                               "tokens' log-probabilities would show; send the request without logprobs")
        if ctx.token_stream is not None and sampling.n > 1:
            raise InvalidInput(f"n: a cached answer is one answer, and this request asks for {sampling.n}; the "
                               "response cache is not consulted for n > 1, so a stage before generate set one")
        if ctx.token_stream is not None:  # served from the response cache: nothing to generate
            scope.set_attribute("inferline.cache.hit", True)
            _, engine = await engine_for(self.resources, ctx.model)
            self._record(ctx, scope, sampling, engine)
            return
        salt = ctx.tenant if config.isolate_tenants else ""
        ctx.facts["generate_request"] = (sampling, salt)  # for stream's retry_invalid
        deadline_s = None if config.queue_timeout_ms is None else time.perf_counter() + config.queue_timeout_ms / 1000
        hints = SchedulingHints(config.priority, ctx.tenant, deadline_s)
        ctx.model, engine, ctx.token_stream = await submit_with_fallback(self.resources, ctx, sampling, salt, hints)
        ctx.finalizers.append(_close_stream)
        self._record(ctx, scope, sampling, engine)
        tried = ctx.facts.get("route", {}).get("fallbacks_tried", [])
        if tried:
            scope.set_attribute("inferline.route.fallbacks_tried", len(tried))
            scope.add_event("inferline.route.fallback", {"models_tried": [t["model"] for t in tried],
                                                         "served_by": ctx.model})

    def _record(self, ctx: RequestContext, scope: StageScope, sampling: SamplingParams, engine: Engine) -> None:
        ctx.facts["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                 "max_tokens": sampling.max_tokens, "seed": sampling.seed}
        if sampling.n > 1:
            ctx.facts["sampling"]["n"] = sampling.n
        if sampling.output is not None:
            ctx.facts["sampling"]["output"] = next(iter(sampling.output))
            ctx.facts["output_constraint"] = sampling.output
        ctx.facts["weights_hash"] = engine.weights_hash
        scope.set_attribute(GEN_AI_OPERATION_NAME, ctx.operation)
        # A remote backend speaks OpenAI's API (serving/backends/remote.py); every other engine is ours.
        scope.set_attribute(GEN_AI_PROVIDER_NAME, "openai" if isinstance(engine, ChatEngine) else "inferline")
        asked = ctx.facts.get("route", {}).get("model") or ctx.facts.get("prompt_model") or ctx.model
        scope.set_attribute(GEN_AI_REQUEST_MODEL, asked)  # what the route asked for; a fallback may answer
        scope.set_attribute(GEN_AI_RESPONSE_MODEL, ctx.model)
        scope.set_attribute(GEN_AI_REQUEST_MAX_TOKENS, sampling.max_tokens)
        scope.set_attribute(GEN_AI_REQUEST_TEMPERATURE, sampling.temperature)
        scope.set_attribute(GEN_AI_REQUEST_TOP_P, sampling.top_p)


async def _close_stream(ctx: RequestContext) -> None:
    """Close the request's token stream as the request ends: its opener owns it (a no-op where ``stream`` read
    it to its end or closed it; ``stream``'s retries close the stream they replace)."""
    if ctx.token_stream is not None:
        await cast(TokenStream, ctx.token_stream).aclose()


def _override_issues(config: GenerateConfig) -> list[CheckIssue]:
    if config.output is not None and config.output.caller_may_override and "output" not in config.client_params:
        return [(("output", "caller_may_override"), "callers cannot set output: add 'output' to client_params, "
                                                     "or remove caller_may_override")]
    return []


def _sampling(config: GenerateConfig, params: dict[str, Any]) -> SamplingParams:
    values = config.model_dump(include=_SAMPLING_FIELDS, exclude={"output": {"caller_may_override"}})
    refused = sorted(set(params) - set(config.client_params))
    if refused:
        raise InvalidInput(f"this pipeline does not let callers set {refused}; allowed: {config.client_params}")
    if "output" in params and config.output is not None and not config.output.caller_may_override:
        own = next(iter(config.output.as_dict()))
        raise InvalidInput(f"this pipeline has its own output constraint ({own}) and does not let callers replace "
                           "it: a response_format, a forced tool call or an 'output' parameter is refused here. "
                           "Send the request without it; the pipeline's owner can allow it with "
                           "caller_may_override: true under the generate stage's output:")
    try:
        merged = Sampling.model_validate({**values, **params})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InvalidInput(f"invalid sampling parameters: {problems}") from None
    if merged.min_tokens > merged.max_tokens:
        raise InvalidInput(f"min_tokens {merged.min_tokens} is over max_tokens {merged.max_tokens}")
    if merged.max_tokens > config.max_tokens:
        raise InvalidInput(f"max_tokens {merged.max_tokens} is over this pipeline's limit of {config.max_tokens}")
    data = merged.model_dump()
    data["stop_token_ids"] = tuple(data["stop_token_ids"])
    data["output"] = merged.output.as_dict() if merged.output is not None else None
    return SamplingParams(**data)


def output_issues(output: OutputSpec, catalog: Catalog) -> list[CheckIssue]:
    """Why a pipeline's own ``output:`` would fail every request: checked at load, never blamed on a caller.

    A JSON Schema is checked against its metaschema (``$schema``, else draft 2020-12, the one ``stream``
    validates answers with), pointing at the bad keyword; then the engines' compile check, when the server
    wired one in, refuses what constrained decoding cannot take (a look-behind, ``uniqueItems``...).
    """
    (kind, value), = output.as_dict().items()
    if kind == "json_schema":
        validator = jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator)
        errors = [jsonschema.exceptions.best_match([e]) for e in validator(validator.META_SCHEMA).iter_errors(value)]
        if errors:
            return [(("output", "json_schema", *e.absolute_path), _schema_message(e)) for e in errors]
    problem = catalog.check_output(kind, value) if catalog.check_output is not None else None
    return [(("output", kind), f"constrained decoding cannot compile it: {problem}")] if problem else []


_SCHEMA_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")


def _schema_message(error: jsonschema.exceptions.ValidationError) -> str:
    steps = list(error.absolute_schema_path)
    is_type = any(steps[i:i + 2] == ["properties", "type"] for i in range(len(steps)))  # the metaschema's "type"
    if is_type and isinstance(error.instance, str) and error.instance not in _SCHEMA_TYPES:
        close = difflib.get_close_matches(error.instance, _SCHEMA_TYPES, n=1, cutoff=0.6)
        fix = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown JSON Schema type {error.instance!r}{fix} (types: {', '.join(_SCHEMA_TYPES)})"
    return f"not a valid JSON Schema: {error.message}"
