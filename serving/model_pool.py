"""Model engines behind the pipeline's ``EngineProvider`` protocol.

One :class:`LocalEngine` per configured local model, started on first use and shared by every
pipeline of the process. This is where the engine's own errors become the pipeline's
(``Overloaded``, ``InvalidInput``, ``BackendError``, ``DeadlineExceeded``), since the engine imports
nothing of ours.

Replicas: ``replicas: N`` runs N independent ``AsyncEngine`` objects for one model, each with its own
step thread, scheduler, KV cache and prefix cache, and its own ``kv_cache.memory_gb`` (the budget is
per replica, not divided: N replicas take N times the KV memory). They share the weights, which the
forward pass only reads: one copy in memory and one load. A :class:`Placement` picks the replica of
each request; with one replica there is nothing to pick and ``submit`` is what it was before.

Remote models (``backend: openai``) come from :func:`serving.remote.open_remote`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from pipeline.errors import BackendError, DeadlineExceeded, InvalidInput, Overloaded
from pipeline.protocols import PRIORITY_CLASSES, ModelLoad, SamplingParams, SchedulingHints, TokenEvent
from pipeline.spec import ModelSpec, ServerSpec
from serving.engine.async_engine import AsyncEngine, RequestStream
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineDeadlineExceeded, EngineError, EngineOverloaded, InvalidRequest
from serving.engine.models import load_model
from serving.engine.sampling_params import SamplingParams as EngineSampling
from serving.piece_cache import piece_encoder
from serving.placement import Placement, ReplicaLoad, ewma

logger = logging.getLogger(__name__)


class HFTokenizer:
    """The pipeline's Tokenizer protocol over a transformers tokenizer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        #: A fast tokenizer's Rust side: the rendered template straight to ids, without transformers'
        #: wrapper (apply_chat_template(tokenize=True) is the same two steps, 298 against 200 us a prompt).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        #: Detokenizing, twice a generated token on the event loop, also goes straight to the Rust side
        #: (1.0 against 2.9 us a call for six tokens) unless transformers would clean the text up after it.
        self._decode_backend = self._backend if self._backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True) else None
        #: The rendered template piece by piece between its special tokens, the pieces every prompt repeats
        #: (system prompt, role headers) remembered (serving/piece_cache.py), where that gives the same ids.
        self._pieces = piece_encoder(self._backend) if self._backend is not None else None

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if self._backend is None:  # no Rust side: the template's own tokenization
            ids = self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        return self._encode(self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                                tokenize=False))

    def encode_chat_tools(self, messages: Sequence[Mapping[str, str]], tools: Sequence[Mapping]) -> list[int] | None:
        """Token ids with *tools* rendered by the model's chat template; None when the template ignores them
        (then stages/tools.py lists the tools in the system message instead)."""
        render = self._tokenizer.apply_chat_template
        plain = render(list(messages), add_generation_prompt=True, tokenize=False)
        text = render(list(messages), tools=list(tools), add_generation_prompt=True, tokenize=False)
        return None if text == plain else self._encode(text)

    def _encode(self, text: str) -> list[int]:
        """A rendered chat template's ids: its special tokens are in the text already."""
        if self._pieces is not None:
            return self._pieces.encode(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._decode_backend is not None:
            return self._decode_backend.decode(token_ids, skip_special_tokens=True)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


# -- local engines --------------------------------------------------------------

#: The pipeline's sampling fields, copied one by one into the engine's: ``dataclasses.asdict`` deep-copies
#: every value (about 100 us a request on the event loop under cProfile).
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


class _Stream:
    """An engine stream whose errors are the pipeline's; reports its first token's time to its model."""

    __slots__ = ("_open", "_owner", "_stream", "_submitted_s", "replica")

    def __init__(self, stream: RequestStream, owner: LocalEngine, replica: int, submitted_s: float):
        self._stream, self._owner = stream, owner
        #: Which of the model's replicas serves this request (0 with one replica).
        self.replica = replica
        self._submitted_s = submitted_s
        self._open = True

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        timed = False
        try:
            async for event in self._stream:
                if not timed and event.token_id is not None:
                    timed = True
                    self._owner.observe_ttft(time.perf_counter() - self._submitted_s)
                yield event
        except EngineDeadlineExceeded as exc:
            raise DeadlineExceeded(f"model {self._owner.name!r}: {exc}") from exc
        except EngineError as exc:
            raise BackendError(f"model {self._owner.name!r}: {exc}") from exc
        finally:
            self._release()

    async def aclose(self) -> None:
        self._release()
        await self._stream.aclose()

    def _release(self) -> None:
        if self._open:
            self._open = False
            self._owner.outstanding[self.replica] -= 1

    def __del__(self) -> None:
        # A stream dropped without being read or closed must not count as load forever.
        self._release()


class LocalEngine:
    """The pipeline's Engine protocol over a model's :class:`AsyncEngine` replicas."""

    def __init__(self, name: str, replicas: AsyncEngine | Sequence[AsyncEngine], weights_hash: str,
                 placement: Placement | None = None):
        self.name = name
        self.replicas = [replicas] if isinstance(replicas, AsyncEngine) else list(replicas)
        #: Replica 0 (the only one, usually): for callers that want an engine's stats.
        self.engine = self.replicas[0]
        self.tokenizer = HFTokenizer(self.engine.tokenizer)
        self.weights_hash = weights_hash
        self.placement = placement or Placement(len(self.replicas))
        #: Per replica, requests submitted whose stream has not ended: this counts the ones still on their way
        #: to the engine thread, which the scheduler's queues do not show yet (a burst would all look idle).
        self.outstanding = [0] * len(self.replicas)
        #: Exponential average of the time from submit to first token; None before the first.
        self.ttft_s: float | None = None

    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str = "", *,
                     hints: SchedulingHints | None = None) -> _Stream:
        submitted_s = time.perf_counter()
        hints = hints or SchedulingHints()
        index = 0
        if len(self.replicas) > 1:
            index = self.placement.choose(prompt_ids, cache_salt, self.replica_loads())
        try:
            stream = await self.replicas[index].submit(
                prompt_ids, EngineSampling(**{name: getattr(sampling, name) for name in _SAMPLING_FIELDS}), cache_salt,
                priority=PRIORITY_CLASSES.index(hints.priority), tenant=hints.tenant, deadline_s=hints.deadline_s)
        except EngineOverloaded as exc:
            raise Overloaded(f"model {self.name!r} is overloaded: {exc}", exc.retry_after_s) from exc
        except InvalidRequest as exc:
            raise InvalidInput(str(exc)) from exc
        except EngineError as exc:
            raise BackendError(f"model {self.name!r}: {exc}") from exc
        self.outstanding[index] += 1
        return _Stream(stream, self, index, submitted_s)

    def replica_loads(self) -> list[ReplicaLoad]:
        """Each replica's load now; no I/O, no lock (counts read while the engine thread runs may be a step old)."""
        loads = []
        for replica, outstanding in zip(self.replicas, self.outstanding, strict=True):
            scheduler = replica.engine.scheduler
            running = scheduler.num_running
            # Outstanding minus running: waiting in the scheduler plus not yet handed to it.
            loads.append(ReplicaLoad(max(scheduler.num_waiting, outstanding - running), running))
        return loads

    def load(self) -> ModelLoad:
        """The model's load: waiting and running summed over replicas, and the recent time to first token."""
        loads = self.replica_loads()
        return ModelLoad(sum(load.waiting for load in loads), sum(load.running for load in loads), self.ttft_s)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s = ewma(self.ttft_s, seconds)

    def named_replicas(self) -> dict[str, AsyncEngine]:
        """Replicas by metrics name: the model's name for replica 0, ``name#i`` for replica i."""
        return {replica_name(self.name, i): replica for i, replica in enumerate(self.replicas)}

    async def shutdown(self) -> None:
        for replica in self.replicas:
            await replica.shutdown()


def replica_name(model: str, index: int) -> str:
    """What replica *index* of *model* is called in metrics and readiness (replica 0: the model's name)."""
    return model if index == 0 else f"{model}#{index}"


class ModelPool:
    """Starts each configured model's engine on first use: local replicas, or a remote client."""

    def __init__(self, server: ServerSpec, root: Path = Path("."), registry: CollectorRegistry | None = None):
        self._specs = server.models
        self._root = root
        #: Where the server listens: what a remote model with ``base_url: self`` calls.
        self._http = server.http
        self._registry = registry
        #: Started models: LocalEngine, or a remote engine (from serving.remote) for other backends.
        self._engines: dict[str, Any] = {}
        self._lock = asyncio.Lock()
        self.default_model = next(iter(server.models), "")

    async def get(self, name: str) -> Any:
        if name in self._engines:
            return self._engines[name]
        async with self._lock:
            if name not in self._engines:
                self._engines[name] = await self._start(name)
        return self._engines[name]

    def load(self, name: str) -> ModelLoad:
        """How busy model *name* is now, without I/O; a model not started yet is idle."""
        engine = self._engines.get(name)
        return ModelLoad() if engine is None else engine.load()

    async def _start(self, name: str) -> Any:
        spec = self._specs.get(name)
        if spec is None:
            raise BackendError(f"no model {name!r} in inferline.yaml (models: {', '.join(self._specs) or 'none'})")
        if spec.backend == "openai":
            return self._open_remote(name, spec)
        if spec.backend == "ray":
            return await self._open_ray(name, spec)
        return await self._start_local(name, spec)

    def _open_remote(self, name: str, spec: ModelSpec) -> Any:
        from serving.remote import open_remote  # httpx's client: only remote models need it

        engine = open_remote(name, spec, self._root, served=self._http)
        logger.info("model %s: remote backend %s", name, engine.base_url)
        return engine

    async def _open_ray(self, name: str, spec: ModelSpec) -> Any:
        try:
            from serving.ray_backend import open_ray_engine  # Ray: only ray models need it
        except ImportError as exc:
            raise BackendError(f"model {name!r}: backend: ray needs Ray Serve (pip install 'inferline[ray]')") from exc
        return await open_ray_engine(name, spec, self._root)

    async def _start_local(self, name: str, spec: ModelSpec) -> LocalEngine:
        draft = spec.speculative.draft_model if spec.speculative else None
        config = engine_config(spec, self._root, self._specs[draft] if draft else None)
        replicas: list[AsyncEngine] = []
        try:
            # Several replicas share one copy of the weights; one replica loads its own, as it always has.
            loaded = None
            if spec.replicas > 1:
                loaded = await asyncio.to_thread(load_model, config.model, config.dtype, config.device)
            for index in range(spec.replicas):
                replicas.append(AsyncEngine(config, name=replica_name(name, index),
                                            metrics_registry=self._registry, loaded=loaded))
                await replicas[-1].start()
        except EngineError as exc:
            for replica in replicas:
                await replica.shutdown()
            raise BackendError(f"model {name!r} failed to start: {exc}") from exc
        weights_hash = await asyncio.to_thread(weights_sha256, Path(config.model))
        logger.info("model %s started: %d replica(s), weights sha256 %s", name, spec.replicas, weights_hash[:12])
        placement = Placement(spec.replicas, spec.placement, config.block_size, max_imbalance=spec.max_imbalance)
        return LocalEngine(name, replicas, weights_hash, placement)

    async def start_all(self) -> None:
        """Start every local model now (the server does, so that it is ready when it says so)."""
        for name, spec in self._specs.items():
            if spec.backend == "local":
                await self.get(name)

    def engines(self) -> dict[str, AsyncEngine]:
        """Every local replica by name (``model``, ``model#1``...), for metrics and readiness."""
        out: dict[str, AsyncEngine] = {}
        for engine in self._engines.values():
            if isinstance(engine, LocalEngine):
                out.update(engine.named_replicas())
        return out

    async def close(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            if isinstance(engine, LocalEngine):
                await engine.shutdown()
            else:
                await engine.aclose()


def weights_sha256(source: Path) -> str:
    """SHA-256 over the weight files of *source* (a .gguf file or a folder's safetensors, in name order)."""
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def engine_config(spec: ModelSpec, root: Path, draft: ModelSpec | None = None) -> EngineConfig:
    """The engine options for a model of ``inferline.yaml`` (resolving ``auto``); *draft*: its draft model's spec."""
    import torch

    if spec.source is None:
        raise BackendError("a local model needs source: (an HF folder or a .gguf file)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device
    dtype = spec.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    kv = spec.kv_cache
    return EngineConfig(
        model=str(root / spec.source), dtype=dtype, device=device, block_size=kv.block_size,
        num_blocks=None if kv.max_blocks == "auto" else kv.max_blocks,
        kv_cache_bytes=int(kv.memory_gb * (1 << 30)), enable_prefix_caching=kv.prefix_cache,
        max_num_seqs=spec.batching.max_num_seqs, max_num_batched_tokens=spec.batching.max_num_batched_tokens,
        max_waiting=spec.batching.max_waiting, max_model_len=spec.context_window,
        **_speculative_options(spec, root, draft),
    )


def _speculative_options(spec: ModelSpec, root: Path, draft: ModelSpec | None) -> dict[str, object]:
    options = spec.speculative
    if options is None:
        return {}
    return {"speculative": options.method, "num_speculative_tokens": options.num_tokens,
            "speculative_max_batch": options.max_batch, "prompt_lookup_max": options.prompt_lookup_max,
            "prompt_lookup_min": options.prompt_lookup_min,
            "draft_model": str(root / draft.source) if draft is not None and draft.source else None}
