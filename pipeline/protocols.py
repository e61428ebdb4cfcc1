"""The small protocols through which stages reach the world.

Stages never import the engine, the vector store or the audit database. They
see these protocols; ``serving`` wires real implementations in, and unit tests
pass fakes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline.cost import Price


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the loader and the stages may know of a model without loading it."""

    name: str
    price: Price = field(default_factory=Price)
    context_window: int | None = None


#: Why the server's engines cannot compile a constrained-decoding ``output`` (its kind and value:
#: ``"regex", "(?<=a)b"``), or None when they can.
OutputCheck = Callable[[str, Any], "str | None"]


@dataclass(frozen=True, slots=True)
class RerankerInfo:
    """A reranker of ``inferline.yaml`` (``rerankers:``), as the loader and the ``retrieve`` stage know it."""

    name: str
    #: cross_encoder: a sentence-transformers CrossEncoder folder; llm: one of the server's models, asked.
    kind: str = "cross_encoder"
    #: kind llm: the model that scores.
    model: str = ""


@dataclass(frozen=True, slots=True)
class Catalog:
    """What a pipeline may refer to, and how the server would compile it: checked at load time."""

    models: Mapping[str, ModelInfo] = field(default_factory=dict)
    indexes: frozenset[str] = frozenset()
    #: Each index's declared metadata fields and their types (string, number, date, list), for its filters.
    index_fields: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: The rerankers a ``retrieve`` stage's ``rerank:`` may name.
    rerankers: Mapping[str, RerankerInfo] = field(default_factory=dict)
    #: The sentence-embedding models (``embedding_models:``), with their prices.
    embedding_models: Mapping[str, ModelInfo] = field(default_factory=dict)
    #: The engines' own compile check of a pipeline's ``output:`` (serving wires it in); None: only what
    #: the stages can check themselves (a JSON Schema against its metaschema).
    check_output: OutputCheck | None = None
    #: The most rounds a ``repeat:`` loop may run (the server's ``workflows.max_rounds``).
    max_rounds: int = 10
    #: The MCP servers (``mcp_servers:``) an ``agent`` step's ``mcp`` tools may name.
    mcp_servers: frozenset[str] = frozenset()
    #: The named header sets (``tool_headers:``) an ``http`` tool's ``headers_from`` may name.
    tool_headers: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample; what ``generate`` hands the engine. ``temperature`` 0 is greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    #: Let the engine's speculative decoding guess tokens (same output, only speed differs).
    speculative: bool = True
    #: Constrained decoding: one of {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}.
    output: dict[str, Any] | None = None
    #: How many answers to sample: the engine prefills the prompt once and forks the others from it;
    #: their token events carry ``index`` (0 to n - 1).
    n: int = 1


#: Priority classes, most urgent first: an engine admits ``interactive`` before ``batch``.
PRIORITY_CLASSES = ("interactive", "batch")


@dataclass(frozen=True, slots=True)
class SchedulingHints:
    """How an engine should queue a request among others; what ``generate`` hands it with the sampling.

    A local engine admits by class (``interactive`` before ``batch``, batch never starved), tenants of
    a class taking turns; a remote backend ignores the hints.
    """

    priority: str = "interactive"
    """One of :data:`PRIORITY_CLASSES`."""
    tenant: str = ""
    deadline_s: float | None = None
    """``time.perf_counter()`` by which the request must have started (prefill); still queued then, it
    ends with :class:`~pipeline.errors.DeadlineExceeded`. None: it waits as long as it takes."""


class TokenEvent(Protocol):
    """One generated token; the last event of a request carries its finish reason.

    A remote backend that streams text rather than token ids also sets ``text`` (the event's text,
    already decoded) and may leave ``token_id`` None; the ``stream`` stage then uses the text as is.
    An engine sampling ``n`` above 1 also sets ``index`` (which answer, 0 to n - 1); each answer's last
    event carries its finish reason.
    """

    token_id: int | None
    """None only on a last event that ends the request without a new token."""
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class TokenStream(Protocol):
    """The token events of one request; ``aclose()`` aborts it and frees its resources."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back, with the model's chat template."""

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of *messages* under the chat template, ready for the assistant's turn."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@runtime_checkable
class Engine(Protocol):
    """A batched token generator for one model: it takes prompt token ids (a :class:`ChatEngine` takes
    chat messages instead)."""

    tokenizer: Tokenizer
    #: SHA-256 of the weights it serves (for audit records); for a remote backend, its URL and model.
    weights_hash: str

    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                     cache_salt: str = "", *, hints: SchedulingHints | None = None) -> TokenStream:
        """Queue a request; raises Overloaded, BackendError or InvalidInput before queueing anything.

        *hints* place it in the queue (None: interactive, no tenant, no deadline); its stream raises
        DeadlineExceeded if it is still queued at ``hints.deadline_s``.
        """
        ...


@runtime_checkable
class ChatEngine(Engine, Protocol):
    """An engine that applies its own chat template: a remote OpenAI-compatible server.

    Stages hand it the chat messages through :meth:`submit_messages`; its ``submit`` refuses token ids
    with InvalidInput, and its ``tokenizer`` may only estimate counts. Stages tell it apart with
    ``isinstance(engine, ChatEngine)``, which also gives a type checker the method, rather than probing
    an attribute: an engine is one by having the method, and cannot claim it without.
    """

    async def submit_messages(self, messages: Sequence[Mapping[str, str]], sampling: SamplingParams,
                              cache_salt: str = "") -> TokenStream:
        """Queue a request of chat *messages*; raises Overloaded, BackendError or InvalidInput before any
        text, so that the caller can still fall back to another model. *cache_salt* may only pick among the
        engine's servers: it cannot partition a remote server's own prefix cache."""
        ...


@dataclass(frozen=True, slots=True)
class ModelOccupancy:
    """How busy a model is, for load-aware routing."""

    waiting: int = 0
    running: int = 0
    #: Recent time to first token (an exponential average), None before the first request.
    ttft_s: float | None = None


class EngineProvider(Protocol):
    """Gives stages the engine of a named model (starting it on first use)."""

    default_model: str

    async def get(self, name: str) -> Engine: ...

    def occupancy(self, name: str) -> ModelOccupancy:
        """How busy model *name* is now (no I/O; a model not started yet is idle)."""
        ...


class SearchHit(Protocol):
    """One retrieved chunk."""

    @property
    def id(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def score(self) -> float: ...


class Retrieval(Protocol):
    """One search of an index: its hits and what each side found before they were fused."""

    @property
    def mode(self) -> str:
        """dense, keyword or hybrid: what ran."""
        ...

    @property
    def hits(self) -> Sequence[SearchHit]:
        """Best first (the fused order in hybrid mode)."""
        ...

    @property
    def dense(self) -> Sequence[tuple[str, float]]:
        """The dense side's candidates, ``(id, cosine similarity)``, best first; empty when it did not search."""
        ...

    @property
    def keyword(self) -> Sequence[tuple[str, float]]:
        """The keyword side's candidates, ``(id, BM25 score)``, best first; empty when it did not search."""
        ...


class VectorIndex(Protocol):
    """Dense, keyword and hybrid search over indexed documents (blocking: stages call it in a thread)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    def search(self, query: str, top_k: int = 4, *, min_score: float | None = None,
               filters: Mapping[str, str | list[str]] | None = None) -> Sequence[SearchHit]: ...

    def retrieve(self, query: str, top_k: int = 4, *, mode: str | None = None, min_score: float | None = None,
                 where: Mapping[str, Any] | None = None, fusion: str = "rrf", rrf_k: int = 60,
                 weights: Mapping[str, float] | None = None, candidates: int = 50) -> Retrieval:
        """The *top_k* hits for *query* by *mode* (None: the index's default, hybrid when it has a keyword side).

        *where* is a metadata filter as plain data (``{"and": [...]}``, ``{"or": [...]}``, or ``{"field", "op":
        eq | in | range | glob, "value"}`` with typed values), applied inside each side's search; *min_score*
        drops candidates whose cosine similarity is below it; hybrid mode fuses *candidates* from each side by
        *fusion* (``rrf`` with *rrf_k*, or ``weighted``), with *weights* by side. Raises ValueError for a mode
        the index cannot search.
        """
        ...


@runtime_checkable
class Reranker(Protocol):
    """A model that scores how well passages answer a query (a cross-encoder), off the event loop."""

    name: str

    async def score(self, query: str, passages: Sequence[str]) -> list[float]:
        """One score per passage, higher is better, in the passages' order."""
        ...


class RerankerProvider(Protocol):
    """Gives stages the cross-encoder reranker of a name (loading it on first use)."""

    async def get(self, name: str) -> Reranker: ...


@dataclass(frozen=True, slots=True)
class Embeddings:
    """What an embedding backend returns for a list of texts."""

    #: ``(len(texts), dimensions)`` float32 rows (a NumPy array), one per text, in the texts' order.
    vectors: Any
    #: Tokens the model read for each text, its special tokens included.
    num_tokens: tuple[int, ...]


@runtime_checkable
class EmbeddingBackend(Protocol):
    """A sentence-embedding model: texts in, unit-length vectors out, batched, off the event loop."""

    name: str
    #: The length of every vector.
    dimensions: int
    #: The most tokens (special ones included) one text may have; longer texts are refused, not cut.
    max_input_tokens: int

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        """The vectors of *texts*, computed in a worker thread in batches; raises InvalidInput naming the
        first text longer than ``max_input_tokens`` before encoding any."""
        ...


class EmbedderProvider(Protocol):
    """Gives stages the embedding model of a name (loading it on first use)."""

    async def get(self, name: str) -> EmbeddingBackend: ...


@runtime_checkable
class AuditSink(Protocol):
    """Where audit records go; must never lose one."""

    async def write(self, record: Mapping[str, Any]) -> None: ...


class CounterState(Protocol):
    """One fixed-window counter after a call: whether it was allowed, the total, when the window ends."""

    @property
    def allowed(self) -> bool: ...

    @property
    def used(self) -> float: ...

    @property
    def reset_s(self) -> float: ...

    @property
    def window_start(self) -> int:
        """Epoch seconds at which the counted window began (give back into that window, not today's)."""
        ...


@runtime_checkable
class Counters(Protocol):
    """Fixed-window counters for rate limits and budgets, shared by every process that uses the same store.

    A window of *window_s* seconds starts at a multiple of *window_s* since the epoch (a day window
    starts at 00:00 UTC), so every process agrees on it without talking to the others.
    """

    async def consume(self, key: str, amount: float, limit: float, window_s: int) -> CounterState:
        """Add *amount* to *key*'s current window, atomically, unless the total would pass *limit*."""
        ...

    async def add(self, key: str, amount: float, window_s: int, window_start: int | None = None) -> None:
        """Add *amount* (negative to give back a reservation) without a limit, to the current window or
        to the one that began at *window_start*."""
        ...

    async def get(self, key: str, window_s: int) -> CounterState:
        """The current window's total."""
        ...


class TextFilter(Protocol):
    """A filter over streamed output text (the policy stage's output rails)."""

    #: What the filter decided so far, as audit-ready dicts (rule, category, action, score, span).
    decisions: list[dict[str, Any]]

    def feed(self, text: str) -> tuple[str, str | None]:
        """Text that is now safe to send, and a finish reason when the stream must stop here."""
        ...

    def flush(self) -> tuple[str, str | None]:
        """Everything still held back, once generation has ended; the same pair as :meth:`feed`."""
        ...

    @property
    def sent_redacted(self) -> str:
        """The text sent so far, as it was before redacted input values were restored into it."""
        ...


class CacheProvider(Protocol):
    """Response-cache backends and the embedder of the ``cache`` stage, wired in by ``serving``."""

    def open_cache(self, backend: str, *, redis_url: str, prefix: str, ttl_s: float, max_entries: int,
                   clock: Callable[[], float]) -> Any:
        """A backend with ``async get(key)``, ``async set(key, value)`` and ``async close()``."""
        ...

    def open_semantic(self, max_entries: int, *, ttl_s: float, clock: Callable[[], float]) -> Any:
        """An in-memory similarity index with ``add(scope, vector, value)`` and ``search(scope, vector, t)``."""
        ...

    def embed(self, text: str) -> Any:
        """The unit embedding vector of *text* (blocking: call it in a thread)."""
        ...


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """What a request to another pipeline returned (a judge's grade, say)."""

    #: ok | denied | failed | cancelled
    status: str
    output_text: str
    cost_usd: float
    request_id: str
    error: str = ""


class PipelineCaller(Protocol):
    """Runs one request through another served pipeline, in-process (the ``score`` stage's judges, the
    ``pipeline`` step's sub-pipelines)."""

    async def call(self, pipeline: str, input: str, tags: Mapping[str, str]) -> PipelineResult: ...

    async def call_nested(self, pipeline: str, version: str | None, ctx: Any,
                          on_text: Callable[[str], Awaitable[None]] | None = None,
                          on_step: Callable[[Any], None] | None = None) -> Any:
        """Run *ctx* (a :class:`~pipeline.context.RequestContext` whose ``parent_request`` is the caller's)
        through *pipeline* (at *version*: its label or spec-hash prefix; None: the one serving) as a part of the
        caller's request: the callee's access roles apply to ``ctx.principal`` (PolicyDenied when they refuse it),
        its audit step writes no record of its own, its answer's text goes to *on_text* as it comes, each of its
        steps' ``StageStarted``/``StageFinished`` to *on_step*; returns the final event (``Done`` or ``Error``)."""
        ...

    async def tool_schema(self, pipeline: str, version: str | None) -> Mapping[str, Any]:
        """*pipeline*'s arguments as a tool (at *version*, as :meth:`call_nested` finds it): a JSON Schema with
        ``input``, ``tags`` and the sampling options it lets callers set; BackendError when it is not served."""
        ...


@dataclass(frozen=True, slots=True)
class ToolReply:
    """What one tool call gave back: its text for the model, and whether the tool reported an error."""

    text: str
    is_error: bool = False


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """A tool as its server lists it: description and JSON Schema of its arguments, and their SHA-256."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    sha256: str


class ToolProvider(Protocol):
    """Runs the tools of ``agent`` steps: MCP servers of the server config, HTTP endpoints (serving wires it)."""

    async def list_mcp(self, server: str) -> Mapping[str, ToolSchema]:
        """The tools *server* offers now, by name (read again when the server says its list changed)."""
        ...

    async def call_mcp(self, server: str, tool: str, arguments: Mapping[str, Any]) -> ToolReply:
        """Call *tool* on *server*; cancelling the call cancels it on the server (``notifications/cancelled``)."""
        ...

    async def call_http(self, method: str, url: str, arguments: Mapping[str, Any], headers_from: str | None,
                        max_response_bytes: int) -> ToolReply:
        """One HTTP request: *arguments* as the query (GET, DELETE) or the JSON body; the headers are the
        server's named set *headers_from* only, never the caller's; a longer body is an error."""
        ...

    def count(self, tool: str, outcome: str) -> None:
        """Count one call of *tool* by its outcome (ok, error, timeout, refused) in the server's metrics."""
        ...

    async def pin(self, pipeline: str, spec_sha256: str, pins: Mapping[str, str]) -> Mapping[str, str]:
        """Keep *pins* (``STEP/SERVER/TOOL`` -> the tool's schema SHA-256) with the pipeline version, where it keeps
        none yet for a tool; the pins kept (the first listing's, across restarts). Without a database, *pins*."""
        ...


@dataclass(slots=True)
class Resources:
    """The live objects a pipeline's stages use, wired in by ``serving``."""

    catalog: Catalog = field(default_factory=Catalog)
    engines: EngineProvider | None = None
    indexes: Mapping[str, VectorIndex] = field(default_factory=dict)
    audit: AuditSink | None = None
    #: Rate-limit and budget counters (SQL or Redis); None: the policy stage refuses limits.
    counters: Counters | None = None
    #: Response caches for the cache stage; None: the stage skips caching (and says so).
    caches: CacheProvider | None = None
    #: Models taken out of rotation after failing: name -> time.monotonic() until which they rest.
    cooldowns: dict[str, float] = field(default_factory=dict)
    #: The other pipelines of this process, for judges; None: judge checks fail (and say so).
    pipelines: PipelineCaller | None = None
    #: The sentence-embedding models of the ``embed`` stage; None: that stage fails (and says so).
    embedders: EmbedderProvider | None = None
    #: The cross-encoder rerankers of ``retrieve``'s ``rerank:``; None: such a rerank fails (and says so).
    rerankers: RerankerProvider | None = None
    #: The tools of ``agent`` steps (MCP servers, HTTP endpoints); None: their calls fail (and say so).
    tools: ToolProvider | None = None
