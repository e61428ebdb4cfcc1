"""``RequestContext``: the one object that flows through a pipeline's stages.

Stages communicate only by reading and writing the typed *flow fields* listed
in :data:`FIELDS`. Each stage type declares which of them it reads and writes,
and the loader checks at load time that every field a stage reads is either
provided by the request (``initial``) or written by an earlier stage.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypedDict, get_type_hints

from pipeline.cost import CostLedger
from pipeline.protocols import Embeddings, TextFilter
from pipeline.types import ValueType


@dataclass(slots=True)
class ChatMessage:
    """One chat turn, as in the OpenAI API."""

    role: str
    content: str


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """*messages* as the ``{"role", "content"}`` dicts tokenizers and OpenAI-compatible servers take."""
    return [{"role": m.role, "content": m.content} for m in messages]


@dataclass(slots=True)
class Principal:
    """Who is calling: an API key's id (never the key), its role and tenant."""

    key_id: str
    role: str
    tenant: str = ""


@dataclass(slots=True)
class Document:
    """A retrieved passage with where it came from."""

    id: str
    text: str
    source: str = ""
    title: str = ""
    score: float = 0.0
    #: The page the passage starts on, for a paged source (a PDF); None otherwise.
    page: int | None = None


@dataclass(frozen=True, slots=True)
class Source:
    """A document an answer was given from, and the number ``n`` it is cited by (``[n]``)."""

    n: int
    id: str
    title: str
    #: The file the passage comes from (``Document.source``).
    path: str
    score: float
    #: The page of *path* the passage starts on (a PDF's), so that it can be cited as "p. 4"; None otherwise.
    page: int | None = None

    @property
    def citation(self) -> str:
        return f"[{self.n}]"


def sources_of(documents: Sequence[Document]) -> tuple[Source, ...]:
    """*documents* numbered as the prompt cites them: ``[1]`` is the first (the best ranked), and so on.

    The one numbering the ``prompt`` stage writes into the prompt and the answer's ``sources`` report.
    """
    return tuple(Source(n, d.id, d.title, d.source, d.score, d.page) for n, d in enumerate(documents, start=1))


@dataclass(slots=True)
class Usage:
    """Token counts for one request."""

    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability (raw: before penalties and temperature), with the likeliest
    tokens' at its position when asked for (``top``, most likely first)."""

    token: str
    """The token's own text (decoded alone)."""
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the ``n`` answers of a request that asked for several (``n`` above 1)."""

    index: int
    text: str = ""
    finish_reason: str = ""
    output_tokens: int = 0
    #: Its tokens' log-probabilities, when the request asked for them (``logprobs``).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class StageRecord:
    """What one step (one attempt of it) did for one request; returned to the caller and audited."""

    id: str
    type: str
    status: str  # ok | skipped | failed | timeout | cancelled | denied
    started_s: float = 0.0
    duration_s: float = 0.0
    cost_usd: float = 0.0
    error: str = ""
    #: Which attempt this is (its retry: runs a step again; each attempt is a record of its own).
    attempt: int = 1
    #: Why a skipped step did not run: when (its when: was false), failed (an earlier step failed, was denied or
    #: the request was cancelled), ended (a step answered and ended the request).
    skip_reason: str = ""
    #: The model tokens it used.
    input_tokens: int = 0
    output_tokens: int = 0
    #: The step it ran in the place of, when it is a fallback.
    fallback_for: str = ""
    #: The step it ran under (a sub-pipeline's steps: ``call``, ``call/answer``), "" at the top.
    parent: str = ""
    #: A for_each step's item this record is of (None: not a for_each step).
    item: int | None = None
    #: The round of its loop (0: not in a loop).
    round: int = 0
    #: Its output was reused from an audit record (a replay by step), not made again.
    reused: bool = False
    #: In a pipeline that audits: the SHA-256 of the step's definition, of what it read (flow fields and
    #: earlier steps' outputs) and of what it gave, and those values (pipeline/digest.py), for the record.
    definition_sha256: str = ""
    inputs_sha256: str = ""
    output_sha256: str = ""
    inputs: dict[str, Any] | None = None
    output: dict[str, Any] | None = None
    #: A tool call of an ``agent`` step (type ``tool``): kind, server, tool, schema and allow list SHA-256s,
    #: the SHA-256s of its arguments and result, outcome, round and duration (stages/agent_calls.py).
    tool: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        """Which run of its step it is: ``id``, ``id[2]`` (an item), ``id@3`` (a round): a replay matches on it."""
        return step_key(self.id, self.item, self.round)


def step_key(step_id: str, item: int | None, round_: int) -> str:
    """:attr:`StageRecord.key` of a step's run."""
    return step_id + (f"[{item}]" if item is not None else "") + (f"@{round_}" if round_ > 1 else "")


@dataclass(frozen=True, slots=True)
class Reusable:
    """A step's run as an audit record kept it: a replay reuses its output where the candidate's step has the
    same definition and reads the same inputs (their SHA-256s)."""

    definition_sha256: str
    inputs_sha256: str
    output: dict[str, Any]


@dataclass(slots=True)
class RoutePlan:
    """What ``route`` decided beyond the model: where ``generate`` goes when it fails."""

    fallbacks: list[str] = field(default_factory=list)
    #: Extra attempts on the same model before moving to the next.
    retries: int = 0
    #: How long a model that failed is left out of rotation.
    cooldown_s: float = 30.0
    #: Give up on a model whose first token takes longer (None: wait).
    first_token_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class FieldInfo:
    """Describes one flow field for load-time checks and error messages; its type is its annotation on
    :class:`RequestContext` (:func:`field_type`)."""

    doc: str
    initial: bool = False


#: The flow fields of :class:`RequestContext`. ``initial`` fields come with the request.
FIELDS: dict[str, FieldInfo] = {
    "request_id": FieldInfo("unique id of this request", initial=True),
    "pipeline": FieldInfo("name of the pipeline serving the request", initial=True),
    "input": FieldInfo("text of the last user message", initial=True),
    "input_messages": FieldInfo("the chat turns the client sent", initial=True),
    "principal": FieldInfo("the caller, when authenticated", initial=True),
    "role": FieldInfo("the caller's role ('' when anonymous)", initial=True),
    "tenant": FieldInfo("the caller's tenant ('' when none)", initial=True),
    "tags": FieldInfo("free-form request tags from the client", initial=True),
    "params": FieldInfo("sampling overrides from the client", initial=True),
    "stop": FieldInfo("stop strings from the client", initial=True),
    "tools": FieldInfo("functions the client offers the model (OpenAI's tools)", initial=True),
    "tool_choice": FieldInfo("auto | none | required | one named function", initial=True),
    "operation": FieldInfo("what the client asked for, as OpenTelemetry's GenAI conventions name it: "
                           "chat, text_completion or embeddings", initial=True),
    "messages": FieldInfo("the prompt's chat messages"),
    "documents": FieldInfo("retrieved passages"),
    "model": FieldInfo("name of the model chosen for the request"),
    "route_plan": FieldInfo("fallback models, retries and timeouts chosen by route"),
    "max_output_tokens": FieldInfo("a cap on generated tokens set by policy (None: no cap)"),
    "output_filter": FieldInfo("output rails the stream stage applies (set by policy)"),
    "prompt_ids": FieldInfo("prompt token ids"),
    "prompt_tokens": FieldInfo("number of prompt tokens"),
    "token_stream": FieldInfo("generated token ids, as they come"),
    "output_text": FieldInfo("the text sent to the client"),
    "output_ids": FieldInfo("the generated token ids, as streamed"),
    "finish_reason": FieldInfo("why generation stopped"),
    "embeddings": FieldInfo("the vectors of the input texts, and their token counts (embed)"),
}

class Facts(TypedDict, total=False):
    """What stages record about a request, by topic: read by later stages, the audit record, the
    response headers, metrics and the console's trace view. Each key names the stage that writes it."""

    #: generate: the sampling the engine ran (temperature, top_p, seed, max_tokens, output kind; n when above 1).
    sampling: dict[str, Any]
    #: generate: the sampling parameters and cache salt it submitted (stream's ``retry_invalid`` resubmits).
    generate_request: tuple[Any, str]
    #: stream: the stop string that ended the output (the pipeline's or the caller's), when one did.
    stop_sequence: str
    #: policy: its input rails over text from outside the request (an agent step's tool results): ``(text,
    #: source)`` -> the text as they let it through (redacted), PolicyDenied when they block it.
    input_rails: Callable[[str, str], str]
    #: generate: the constraint the output was decoded under (stream validates the text against it).
    output_constraint: dict[str, Any]
    #: generate: the SHA-256 of the weights that answered.
    weights_hash: str
    #: tokenize (and a failover to another tokenizer): the model whose tokenizer encoded the prompt.
    prompt_model: str
    #: route (and failover): the model chosen, how, why, and the fallbacks tried.
    route: dict[str, Any]
    #: route: ``when:`` rules that failed to evaluate (the rule is skipped, the error kept).
    route_rule_errors: list[str]
    #: retrieve: the index, its version, and the ids and scores of the documents found.
    retrieval: dict[str, Any]
    #: policy: every rule that fired (rule, action, where).
    policy: list[dict[str, Any]]
    #: policy: the input before redaction, and the input as redacted.
    original_input: str
    #: policy: the client's messages as sent, when its input rails changed any (the audit record's chat).
    original_messages: list[ChatMessage]
    redacted_input: str
    #: stream: the output as sent, redacted by an output filter.
    redacted_output: str
    #: policy's limits: what is left of each budget (the rate-limit response headers).
    limits: dict[str, Any]
    #: cache: hit or not, exact or semantic, the similarity and age, or why it was skipped.
    cache: dict[str, Any]
    #: score: the checks a sampled request ran and their results (the server counts them).
    online_eval: dict[str, Any]
    #: Each stage's own summary of what it decided, by stage id (the audit record's per-stage ``decision``).
    decisions: dict[str, dict[str, Any]]
    #: audit: set once a record was written (the server then records no refusal of its own).
    audited: bool
    #: The embeddings route: the texts to embed as the client sent them, one user message each in
    #: ``input_messages`` (which policy may redact); the audit record's content is this list, never the vectors.
    input_texts: list[str]
    #: embed: the embedding model, the number of texts and tokens, and the vectors' length.
    embedding: dict[str, Any]
    #: agent: the state of a tool loop paused for the client's approval (its turns, round, calls; the server
    #: keeps it, and shows ``requests``: id, name, server_label, arguments of each call awaiting approval).
    approval_pending: dict[str, Any]
    #: agent: each tool call made, as the client may be shown it (serving/http/openai_mcp.py ``mcp_items``):
    #: ``step``, ``id``, ``kind``, ``server``, ``name``, ``arguments``, ``outcome``, ``output`` (what the model
    #: was told of an ok call's result, after the policy's rails), ``error``, ``approval_request_id``.
    tool_calls: list[dict[str, Any]]
    #: agent: the MCP tools each step offered its model, by server: ``{"step", "server", "tools": [{"name",
    #: "description", "input_schema"}]}``.
    tools_listed: list[dict[str, Any]]
    #: The server, resuming a paused request: ``{"state": approval_pending as kept, "decisions": {id: bool}}``.
    approval_resume: dict[str, Any]
    #: The server, where a paused request can be resumed: keeps ``approval_pending`` (the agent step awaits it as
    #: it pauses; BackendError when it cannot, and the step fails: a pause that cannot be resumed is a failure).
    approval_keeper: Callable[[RequestContext], Awaitable[None]]
    #: The server, on a shadow run: the request it mirrors as served (version, output hash, latency,
    #: tokens, cost, policy decision), which the audit record sets beside the shadow's own.
    shadow: dict[str, Any]


#: The item a for_each step runs for now, with its index (each item runs in a task of its own, which copies it).
CURRENT_ITEM: ContextVar[tuple[int, Any] | None] = ContextVar("inferline_current_item", default=None)


@dataclass(slots=True)
class RequestContext:
    """State of one request as it flows through one pipeline."""

    pipeline: str
    input_messages: list[ChatMessage]
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    principal: Principal | None = None
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    #: Functions the model may call, as OpenAI's ``tools`` (see stages/tools.py); empty: none offered.
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    operation: str = "chat"
    messages: list[ChatMessage] = field(default_factory=list)
    documents: list[Document] = field(default_factory=list)
    model: str = ""
    max_output_tokens: int | None = None
    route_plan: RoutePlan | None = None
    output_filter: TextFilter | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    token_stream: AsyncIterator[int] | None = None
    output_text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    embeddings: Embeddings | None = None
    usage: Usage = field(default_factory=Usage)
    #: With ``n`` above 1 (the generate stage's sampling), every answer in index order; ``output_text`` and
    #: ``finish_reason`` are then choice 0's, and ``usage.output_tokens`` counts all of them. Empty with n = 1.
    choices: list[Choice] = field(default_factory=list)
    #: With ``logprobs`` asked for, the generated tokens' log-probabilities (choice 0's with n above 1).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ledger: CostLedger = field(default_factory=CostLedger)
    stages: list[StageRecord] = field(default_factory=list)
    #: ok | denied | failed | cancelled: how the request is going so far.
    status: str = "ok"
    #: The error that failed or denied the request, if any.
    error: BaseException | None = None
    trace_id: str = ""
    #: When the request arrived (UTC); the runner's timings are relative to it.
    received_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    #: Seconds from arrival to the first text delta (set by the runner).
    ttft_s: float | None = None
    #: Set by the runner from the pipeline it runs, for audit records.
    pipeline_version: str = ""
    spec_sha256: str = ""
    #: Set by the HTTP layer.
    client_addr: str = ""
    #: Set by the server on a shadow run: the id of the request it mirrors. A shadow's answer is never
    #: sent; limits do not count it and the response cache neither answers nor keeps it.
    shadow_of: str = ""
    #: What stages record about the request, by topic (:class:`Facts`).
    facts: Facts = field(default_factory=lambda: Facts())
    #: Each step's outputs once it ended, by step id (``status`` besides): what ``steps.ID.FIELD`` reads.
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: A replay by step: the outputs it may reuse, by StageRecord.key (serving/evals/replay.py).
    reuse: dict[str, Reusable] = field(default_factory=dict)
    #: A sub-pipeline's run (a ``pipeline`` step): the calling request's id. Its audit step writes no record:
    #: the caller's record holds its steps.
    parent_request: str = ""
    #: Called by the runner after every stage has run, however the request ended
    #: (the policy stage settles token and cost budgets here).
    finalizers: list[Callable[[RequestContext], Awaitable[None]]] = field(default_factory=list)

    @classmethod
    def from_text(cls, pipeline: str, text: str, **kwargs: Any) -> RequestContext:
        """A context for a single user message."""
        return cls(pipeline=pipeline, input_messages=[ChatMessage("user", text)], **kwargs)

    @property
    def input(self) -> str:
        for message in reversed(self.input_messages):
            if message.role == "user":
                return message.content
        return ""

    @property
    def role(self) -> str:
        return self.principal.role if self.principal else ""

    @property
    def tenant(self) -> str:
        return self.principal.tenant if self.principal else ""

    def field_value(self, name: str) -> Any:
        """The value of flow field *name*, of ``steps``, or of a for_each step's ``item`` and ``item_index`` (used
        by expressions and templates)."""
        if name == "steps":
            return self.steps
        if name in ("item", "item_index"):
            current = CURRENT_ITEM.get()
            if current is None:
                raise KeyError(name)
            return current[1] if name == "item" else current[0]
        if name not in FIELDS:
            raise KeyError(name)
        return getattr(self, name)


def field_type(name: str) -> ValueType:
    """The type of flow field *name*, from its annotation on :class:`RequestContext` (a property's return)."""
    return _FIELD_TYPES[name]


def _field_types() -> dict[str, ValueType]:
    hints = get_type_hints(RequestContext)
    found = {}
    for name in FIELDS:
        member = getattr(RequestContext, name, None)
        annotation = get_type_hints(member.fget)["return"] if isinstance(member, property) else hints[name]
        found[name] = ValueType.of(annotation)
    return found


_FIELD_TYPES = _field_types()
#: What a ``when:`` expression may name, with its type: every flow field (``principal.tenant`` reads a field of
#: the record it holds; a mapping's keys, ``tags.tier``, are the client's: untyped), and ``steps``, the outputs of
#: the steps before it, which the loader adds per step.
EXPRESSION_TYPES: dict[str, ValueType] = dict(_FIELD_TYPES)
