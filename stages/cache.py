"""The ``cache`` stage: answers a repeated deterministic request from a response cache.

YAML (after ``tokenize``, before ``generate``)::

    - id: cache
      type: cache
      with:
        backend: memory        # memory | redis
        redis_url: redis://127.0.0.1:6379/0
        prefix: inferline      # redis key prefix
        ttl_s: 3600
        max_entries: 10000     # memory: LRU beyond this
        max_entry_bytes: 65536 # larger answers are not stored
        semantic: {enabled: false, threshold: 0.92, max_entries: 2000}

Only deterministic requests are cached: a request whose params set
``temperature`` above 0 without a seed is not even looked up, and an answer is
stored only when generate actually ran greedy or seeded (``facts["sampling"]``,
from the generate stage's own config), so a sampling pipeline never caches. Requests that
ask for ``logprobs`` or for ``n`` above 1, and models behind a remote backend (no faithful token ids
to replay) are not cached either; ``ctx.facts["cache"]["skipped"]`` says why.

The key is a SHA-256 over the pipeline's spec hash, the model, the validated
``params`` (sorted), the client's stop strings, the policy's output cap and
``prompt_ids`` (which already encode the system prompt, documents and
history). A hit sets ``token_stream`` to a replay of the cached token ids, so
``generate`` submits nothing and ``stream`` detokenizes (and applies its stop
strings and output rails) as usual. A miss registers a finalizer that stores
the streamed ``output_ids`` once the request ended ``ok`` with finish reason
``stop`` or ``length``, unless the answer is over ``max_entry_bytes`` or
generate fell back to another model.

The semantic cache, when enabled, is consulted on an exact miss: the last
user message is embedded (the server's ``CacheProvider``: all-MiniLM-L6-v2) and a stored
request of the same pipeline, tenant, model, settings and earlier turns whose
message is at least ``threshold`` similar (cosine) answers it. Its index is
held in this process's memory whatever the backend. A failing backend (Redis
down) or embedder is logged and counts as a miss: the request still succeeds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, Protocol, cast

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from pipeline.context import RequestContext
from pipeline.errors import BackendError
from pipeline.protocols import CacheProvider, Catalog, ChatEngine
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from stages.engines import engine_for
from stages.generate import Sampling

logger = logging.getLogger(__name__)

#: Finish reasons of a complete answer; anything else (a filter, an error) is never stored.
STORED_FINISH_REASONS = ("stop", "length")


class SemanticConfig(NoConfig):
    #: On an exact miss, replay the answer to a similar enough earlier message.
    enabled: bool = False
    #: Cosine similarity (of unit MiniLM vectors) at or above which a stored answer is replayed.
    threshold: float = Field(0.92, gt=0, le=1)
    #: Messages the semantic index holds; the least recently used go first.
    max_entries: int = Field(2000, ge=1)


class CacheConfig(NoConfig):
    #: Where answers are kept: this process's memory, or a Redis server shared by every process.
    backend: Literal["memory", "redis"] = "memory"
    #: backend redis: the server's URL.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: backend redis: the prefix of every key.
    prefix: str = Field("inferline", min_length=1)
    #: How long a stored answer is served.
    ttl_s: float = Field(3600, gt=0)
    #: backend memory: answers kept; the least recently used go first.
    max_entries: int = Field(10_000, ge=1)
    #: Larger answers are not stored.
    max_entry_bytes: int = Field(65_536, ge=64)
    #: Serve one tenant's cached answers to another (faster, but a tenant could tell by the speed
    #: what another asked: the prefix cache's isolate_tenants would be undone). Off by default.
    share_across_tenants: bool = False
    #: The semantic cache (by embedding similarity).
    semantic: SemanticConfig = Field(default_factory=SemanticConfig)


class Backend(Protocol):
    """What the stage needs of a cache (``store.response_cache``)."""

    async def get(self, key: str) -> dict[str, Any] | None: ...

    async def set(self, key: str, value: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class ReplayEvent:
    """One cached token, shaped like an engine's ``TokenEvent``."""

    __slots__ = ("finish_reason", "num_cached_tokens", "num_output_tokens", "num_prompt_tokens", "token_id")

    def __init__(self, token_id: int | None, finish_reason: str | None, num_prompt_tokens: int,
                 num_output_tokens: int):
        self.token_id, self.finish_reason = token_id, finish_reason
        # The whole prompt counts as cached: nothing was prefilled for it.
        self.num_prompt_tokens = self.num_cached_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens


class ReplayStream:
    """A ``TokenStream`` over cached token ids; the last event carries the cached finish reason."""

    def __init__(self, ids: list[int], finish_reason: str, num_prompt_tokens: int):
        self.ids, self.finish_reason, self.num_prompt_tokens = ids, finish_reason, num_prompt_tokens
        self.closed = False

    def __aiter__(self) -> AsyncIterator[ReplayEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[ReplayEvent]:
        if not self.ids:  # an empty answer still ends with its finish reason
            yield ReplayEvent(None, self.finish_reason, self.num_prompt_tokens, 0)
            return
        last = len(self.ids)
        for index, token_id in enumerate(self.ids, start=1):
            yield ReplayEvent(token_id, self.finish_reason if index == last else None, self.num_prompt_tokens, index)

    async def aclose(self) -> None:
        self.closed = True


class CacheStage(Stage):
    """Replays cached answers of deterministic requests; stores new ones after the request."""

    type_name = "cache"
    Config = CacheConfig
    reads = frozenset({"prompt_ids", "model", "params"})
    # token_stream is written on a hit only, so it is not declared: a pipeline still needs its generate stage.
    writes: frozenset[str] = frozenset()
    before = frozenset({"generate"})  # a hit replaces generation; after it, it would replace a live stream

    def __init__(self, stage_id: str, config: BaseModel, resources: Any):
        super().__init__(stage_id, config, resources)
        #: Wall-clock seconds for entry ages and expiry (tests replace it before the first request).
        self.clock: Callable[[], float] = time.time
        self._backend: Backend | None = None
        self._semantic: Any = None

    @classmethod
    def required_reads(cls, config: BaseModel) -> frozenset[str]:
        return cls.reads | {"input"} if cast(CacheConfig, config).semantic.enabled else cls.reads

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        c = cast(CacheConfig, config)
        if c.backend == "redis" and not c.redis_url.startswith(("redis://", "rediss://", "unix://")):
            return [(("redis_url",), "a Redis URL starts with redis://, rediss:// or unix://")]
        return []

    @property
    def backend(self) -> Backend:
        """The cache, created on first use and kept for the life of this stage instance."""
        if self._backend is None:
            c = cast(CacheConfig, self.config)
            self._backend = self._provider().open_cache(c.backend, redis_url=c.redis_url, prefix=c.prefix,
                                                        ttl_s=c.ttl_s, max_entries=c.max_entries, clock=self.clock)
        return self._backend

    @property
    def semantic(self) -> Any:
        if self._semantic is None:
            c = cast(CacheConfig, self.config)
            self._semantic = self._provider().open_semantic(c.semantic.max_entries, ttl_s=c.ttl_s, clock=self.clock)
        return self._semantic

    def _provider(self) -> CacheProvider:
        provider = self.resources.caches
        if provider is None:
            raise BackendError(f"cache stage {self.id!r}: this process has no response-cache provider")
        return provider

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        try:
            await self._lookup(ctx, scope)
        finally:  # hit, miss or skipped: in the audit record's stage decision too
            if "cache" in ctx.facts:
                ctx.facts.setdefault("decisions", {})[self.id] = dict(ctx.facts["cache"])

    async def _lookup(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(CacheConfig, self.config)
        model, engine = await engine_for(self.resources, ctx.model)
        params, skipped = _cacheable(ctx.params)
        if self.resources.caches is None:
            skipped = "no_cache_provider"
        if isinstance(engine, ChatEngine):  # it streams text: no faithful token ids to replay
            skipped = "remote_backend"
        if ctx.shadow_of:  # a shadow measures the candidate's own answer, and keeps none
            skipped = "shadow"
        if skipped:
            ctx.facts["cache"] = {"hit": False, "skipped": skipped}
            scope.set_attribute("inferline.cache.hit", False)
            return
        key = request_key(ctx, f"{model}@{engine.weights_hash}", params,
                          "" if config.share_across_tenants else ctx.tenant)
        facts: dict[str, Any] = {"hit": False, "key": key[:16]}
        entry = await self._get(ctx, key, facts)
        semantic_scope, vector = "", None
        if entry is None and config.semantic.enabled and ctx.input:
            semantic_scope = semantic_key(ctx, model, params)
            vector = await self._embed(ctx, facts)
            entry = self._search(semantic_scope, vector, facts)
        if entry is not None:
            self._replay(ctx, scope, entry, facts)
            return
        ctx.facts["cache"] = facts
        scope.set_attribute("inferline.cache.hit", False)
        ctx.finalizers.append(self._storer(key, model, semantic_scope, vector))

    async def _get(self, ctx: RequestContext, key: str, facts: dict[str, Any]) -> dict[str, Any] | None:
        try:
            entry = await self.backend.get(key)
        except Exception as exc:  # a cache that fails is a miss, never a failed request
            self._warn(ctx, "lookup", exc, facts)
            return None
        if entry is not None:
            facts.update(hit=True, kind="exact")
        return entry

    async def _embed(self, ctx: RequestContext, facts: dict[str, Any]) -> np.ndarray | None:
        try:
            return await asyncio.to_thread(self._provider().embed, ctx.input)
        except Exception as exc:
            self._warn(ctx, "embedding", exc, facts)
            return None

    def _search(self, scope_key: str, vector: np.ndarray | None, facts: dict[str, Any]) -> dict[str, Any] | None:
        if vector is None:
            return None
        found = self.semantic.search(scope_key, vector, cast(CacheConfig, self.config).semantic.threshold)
        if found is None:
            return None
        facts.update(hit=True, kind="semantic", similarity=round(found[0], 4))
        return found[1]

    def _replay(self, ctx: RequestContext, scope: StageScope, entry: dict[str, Any], facts: dict[str, Any]) -> None:
        ctx.token_stream = ReplayStream(list(entry["ids"]), entry["finish_reason"], len(ctx.prompt_ids))
        facts["age_s"] = round(max(0.0, self.clock() - float(entry["created"])), 3)
        ctx.facts["cache"] = facts
        scope.set_attribute("inferline.cache.hit", True)
        scope.set_attribute("inferline.cache.kind", facts["kind"])

    def _storer(self, key: str, model: str, semantic_scope: str,
                vector: np.ndarray | None) -> Callable[[RequestContext], Awaitable[None]]:
        """The finalizer that stores this request's answer once it has ended well."""
        max_bytes = cast(CacheConfig, self.config).max_entry_bytes

        async def store(ctx: RequestContext) -> None:
            if ctx.status != "ok" or ctx.finish_reason not in STORED_FINISH_REASONS or ctx.model != model:
                return  # failed, cut short, filtered, or answered by a fallback model under another key
            sampling = ctx.facts.get("sampling", {})
            if sampling.get("temperature") != 0 and sampling.get("seed") is None:
                return  # generate sampled (its own config, which this stage cannot see): not repeatable
            if ctx.output_text and not ctx.output_ids:
                return  # text without token ids (a text-only backend): nothing faithful to replay
            value = {"ids": list(ctx.output_ids), "finish_reason": ctx.finish_reason, "created": self.clock()}
            if len(json.dumps(value, separators=(",", ":"))) > max_bytes:
                return
            try:
                await self.backend.set(key, value)
            except Exception as exc:
                self._warn(ctx, "store", exc, None)
            if vector is not None:
                self.semantic.add(semantic_scope, vector, value)

        return store

    async def aclose(self) -> None:
        """Close the backend's connections (Redis), if it was ever created."""
        backend, self._backend = self._backend, None
        if backend is not None:
            await backend.close()

    def _warn(self, ctx: RequestContext, what: str, exc: Exception, facts: dict[str, Any] | None) -> None:
        # The exception's type and message only: never the prompt, which may be confidential.
        logger.warning("request %s: cache %r %s failed (%s: %s); treated as a miss", ctx.request_id, self.id,
                       what, type(exc).__name__, exc)
        if facts is not None:
            facts["error"] = f"{what}: {type(exc).__name__}"


def _cacheable(params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The caller's params as generate validates them, and why the request is not cacheable ('' if it is)."""
    try:
        # Validated and normalised (temperature 0 == 0.0) so equal requests get equal keys.
        normal = Sampling.model_validate(params).model_dump(include=set(params))
    except ValidationError:
        return {}, "invalid_params"  # generate refuses them, with a proper message
    if normal.get("logprobs") is not None:
        return normal, "logprobs"  # a replay has none to give
    if normal.get("n", 1) > 1:
        return normal, "n"  # a cached answer is one answer
    if normal.get("seed") is not None:
        return normal, ""
    if "temperature" in normal:
        return normal, "" if normal["temperature"] == 0 else "sampled"
    return normal, ""


def _digest(parts: list[Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def request_key(ctx: RequestContext, model: str, params: dict[str, Any], tenant: str = "") -> str:
    """The exact cache key: everything that decides a deterministic answer (and the tenant, unless shared).
    *model* names the weights too (``name@weights_hash``): new weights under an old name start afresh."""
    return _digest(["exact", ctx.spec_sha256, tenant, model, params, ctx.stop, ctx.max_output_tokens,
                    ctx.prompt_ids])


def semantic_key(ctx: RequestContext, model: str, params: dict[str, Any]) -> str:
    """The semantic scope: the exact key's settings, the pipeline, the tenant and the turns before the last
    user message (a follow-up such as "and the second one?" only matches in the same conversation)."""
    last = max((i for i, m in enumerate(ctx.input_messages) if m.role == "user"), default=-1)
    earlier = [[m.role, m.content] for i, m in enumerate(ctx.input_messages) if i != last]
    return _digest(["semantic", ctx.spec_sha256, ctx.pipeline, ctx.tenant, model, params, ctx.stop,
                    ctx.max_output_tokens, earlier])

