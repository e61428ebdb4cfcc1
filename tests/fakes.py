"""Small stage types for testing the loader and the runner (fakes of real stages)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pydantic import Field

from pipeline.context import Document, RequestContext
from pipeline.errors import BackendError, InvalidInput, PolicyDenied
from pipeline.protocols import ModelOccupancy
from pipeline.refs import IndexRef, ModelRef
from pipeline.stage import NoConfig, Stage, StageScope


class RecordConfig(NoConfig):
    note: str = ""
    delay_s: float = 0.0
    cost_usd: float = 0.0


#: Every RecordStage run appends its stage id here (tests clear it).
CALLS: list[str] = []


class RecordStage(Stage):
    """Appends its id to CALLS, optionally sleeps and reports a cost."""

    type_name = "record"
    Config = RecordConfig

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config: RecordConfig = self.config  # type: ignore[assignment]
        CALLS.append(self.id)
        if config.delay_s:
            await asyncio.sleep(config.delay_s)
        if config.cost_usd:
            scope.add_cost(config.cost_usd, "compute", config.note)


class FailStage(Stage):
    type_name = "fail"

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        CALLS.append(self.id)
        raise ValueError("boom")


class DenyStage(Stage):
    type_name = "deny"

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        CALLS.append(self.id)
        raise PolicyDenied("not allowed here", rule="r1", category="test")


class EchoConfig(NoConfig):
    chunks: int = 3
    delay_s: float = 0.0


class EchoStage(Stage):
    """Streams the input back in chunks, like a tiny model."""

    type_name = "echo"
    Config = EchoConfig
    reads = frozenset({"input"})
    writes = frozenset({"output_text"})

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config: EchoConfig = self.config  # type: ignore[assignment]
        CALLS.append(self.id)
        text = ctx.input
        size = max(1, len(text) // config.chunks)
        for start in range(0, len(text), size):
            if config.delay_s:
                await asyncio.sleep(config.delay_s)
            await scope.emit_text(text[start:start + size])
        ctx.output_text = text


class RouteConfig(NoConfig):
    default: ModelRef
    fallback: list[ModelRef] = Field(default_factory=list)


class RouteStage(Stage):
    """Picks ``default``: enough of a router to test model references."""

    type_name = "pick"
    Config = RouteConfig
    writes = frozenset({"model"})

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        CALLS.append(self.id)
        ctx.model = self.config.default  # type: ignore[attr-defined]
        scope.set_attribute("gen_ai.request.model", ctx.model)


class SearchConfig(NoConfig):
    index: IndexRef
    top_k: int = 4


class SearchStage(Stage):
    """Writes fixed documents; stands in for retrieve in loader and prompt tests."""

    type_name = "search"
    Config = SearchConfig
    reads = frozenset({"input"})
    writes = frozenset({"documents"})

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        CALLS.append(self.id)
        ctx.documents = [Document("d1", "Paris is the capital of France.", "atlas.md", "Atlas", 0.9)]


class NeedsTokensStage(Stage):
    """Reads prompt_ids, which only a tokenize stage would write."""

    type_name = "needs-tokens"
    reads = frozenset({"prompt_ids"})


class TokenizeStage(Stage):
    type_name = "tokenize-fake"
    reads = frozenset({"messages"})
    writes = frozenset({"prompt_ids", "prompt_tokens"})

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        CALLS.append(self.id)
        ctx.prompt_ids = [ord(c) for c in ctx.input]
        ctx.prompt_tokens = len(ctx.prompt_ids)


TEST_STAGES = (RecordStage, FailStage, DenyStage, EchoStage, RouteStage, SearchStage,
               NeedsTokensStage, TokenizeStage)


class ByteTokenizer:
    """One token per UTF-8 byte: enough to test chat encoding and streaming."""

    def encode_chat(self, messages) -> list[int]:
        return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())

    def decode(self, token_ids) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


class FakeTokenEvent:
    __slots__ = ("finish_reason", "num_cached_tokens", "num_output_tokens", "num_prompt_tokens", "token_id")

    def __init__(self, token_id, finish_reason, num_prompt_tokens, num_output_tokens):
        self.token_id, self.finish_reason = token_id, finish_reason
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens = num_prompt_tokens, 0, num_output_tokens


class FakeStream:
    def __init__(self, reply: bytes, num_prompt_tokens: int, max_tokens: int):
        self.reply, self.num_prompt_tokens, self.max_tokens = reply, num_prompt_tokens, max_tokens
        self.closed = False
        self.sent = 0

    def __aiter__(self):
        return self._events()

    async def _events(self):
        tokens = list(self.reply[:self.max_tokens])
        for index, token in enumerate(tokens, start=1):
            await asyncio.sleep(0)
            self.sent = index
            last = index == len(tokens)
            reason = ("length" if len(self.reply) > self.max_tokens else "stop") if last else None
            yield FakeTokenEvent(token, reason, self.num_prompt_tokens, index)

    async def aclose(self):
        self.closed = True


class FakeEngine:
    """Answers every prompt with ``reply``; records what it was asked."""

    def __init__(self, reply: str = "Paris is the capital. ¡Olé! 👋"):
        self.tokenizer = ByteTokenizer()
        self.weights_hash = "f" * 64
        self.reply = reply.encode()
        self.submitted: list[tuple[list[int], object, str]] = []
        #: The scheduling hints of each submission, in the same order.
        self.hints: list[object] = []
        self.streams: list[FakeStream] = []

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        self.submitted.append((list(prompt_ids), sampling, cache_salt))
        self.hints.append(hints)
        stream = FakeStream(self.reply, len(prompt_ids), sampling.max_tokens)
        self.streams.append(stream)
        return stream


class FakeChatEngine(FakeEngine):
    """A ChatEngine like serving.backends.remote.RemoteEngine: takes chat messages, refuses token ids."""

    def __init__(self, reply: str = "From afar."):
        super().__init__(reply)
        #: The messages of each submission, in order.
        self.messages: list[list[dict[str, str]]] = []

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        raise InvalidInput("this engine takes chat messages (submit_messages), not token ids")

    async def submit_messages(self, messages, sampling, cache_salt=""):
        self.messages.append([dict(message) for message in messages])
        prompt = self.tokenizer.encode_chat(messages)
        self.submitted.append((prompt, sampling, cache_salt))
        stream = FakeStream(self.reply, len(prompt), sampling.max_tokens)
        self.streams.append(stream)
        return stream


class FakeEngines:
    """An EngineProvider with one fake engine per model name."""

    def __init__(self, default_model: str = "smol", **engines: FakeEngine):
        self.default_model = default_model
        self.engines = engines or {default_model: FakeEngine()}
        self.loads: dict[str, ModelOccupancy] = {}

    async def get(self, name: str) -> FakeEngine:
        if name not in self.engines:
            raise BackendError(f"no model {name!r}")
        return self.engines[name]

    def occupancy(self, name: str) -> ModelOccupancy:
        return self.loads.get(name, ModelOccupancy())


class MemoryCounters:
    """The Counters protocol in a dict, for policy-stage unit tests (the real ones: tests/store)."""

    def __init__(self, reset_s: float = 30.0):
        self.values: dict[str, float] = {}
        self.reset_s = reset_s

    async def consume(self, key, amount, limit, window_s):
        used = self.values.get(key, 0.0)
        if used + amount > limit:
            return CounterState(False, used, self.reset_s)
        self.values[key] = used + amount
        return CounterState(True, used + amount, self.reset_s)

    async def add(self, key, amount, window_s, window_start=None):
        self.values[key] = self.values.get(key, 0.0) + amount

    async def get(self, key, window_s):
        return CounterState(True, self.values.get(key, 0.0), self.reset_s)


@dataclass(frozen=True)
class CounterState:
    allowed: bool
    used: float
    reset_s: float
    window_start: int = 0


@dataclass(frozen=True)
class Hit:
    """A search result (pipeline.protocols.SearchHit)."""

    id: str
    text: str
    source: str
    title: str
    score: float


@dataclass(frozen=True)
class FakeRetrieval:
    """One search's result (pipeline.protocols.Retrieval)."""

    mode: str
    hits: list
    dense: list
    keyword: list


class FakeIndex:
    """A ``handbook`` index with two passages, searched densely; records each search."""

    name, version = "handbook", "v7"

    def __init__(self):
        self.calls = []
        #: The keyword arguments of each ``retrieve`` (mode, where, fusion...).
        self.options = []

    def search(self, query, top_k=4, *, min_score=None, filters=None):
        self.calls.append((query, top_k, min_score, filters))
        hits = [Hit("billing#3", "Plus costs $8.", "billing.md", "Billing", 0.81),
                Hit("refunds#9", "Refunds within 21 days.", "refunds.md", "Refunds", 0.42)]
        return [h for h in hits if min_score is None or h.score >= min_score][:top_k]

    def retrieve(self, query, top_k=4, *, mode=None, min_score=None, where=None, **options):
        hits = self.search(query, top_k, min_score=min_score, filters=where)
        self.options.append({"mode": mode, "where": where, **options})
        return FakeRetrieval(mode or "dense", hits, [(h.id, h.score) for h in hits], [])
