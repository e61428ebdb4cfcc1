"""``inferline.yaml``: :class:`ServerSpec`, the resources shared by every pipeline of one server.

The models live in :mod:`serving.config.models`, the audit log's settings in :mod:`serving.config.audit`;
here are the rest (indexes, telemetry, auth, HTTP, limits, reload, responses) and the file's root.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, StringConstraints, field_validator, model_validator

from pipeline.spec import NAME_PATTERN, Strict
from serving.config.audit import AuditSpec
from serving.config.models import SELF_URL, EmbeddingModelSpec, ModelSpec, RaySpec

#: An index name is also a folder name (``indexes/<name>``): never a path.
IndexName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
#: A metadata field: a name a filter can write as a YAML key.
FieldName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
#: Fields every indexed document has.
BUILTIN_FIELDS = frozenset({"doc_id", "path", "title"})


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
    #: The documents' metadata fields that ``retrieve`` filters may name, with their types; the values come from
    #: YAML front matter and ``metadata.json`` files, and a value of another type skips its document at build.
    metadata: dict[FieldName, Literal["string", "number", "date", "list"]] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _not_builtin(cls, metadata: dict[str, str]) -> dict[str, str]:
        taken = sorted(set(metadata) & BUILTIN_FIELDS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: built-in fields of every document (doc_id, path, title); "
                             "use another name")
        return metadata


class RerankerSpec(Strict):
    """A reranker a ``retrieve`` stage's ``rerank:`` may name."""

    #: cross_encoder: a sentence-transformers CrossEncoder folder; llm: one of this file's models asked whether each
    #: passage answers the question.
    type: Literal["cross_encoder", "llm"] = "cross_encoder"
    #: type cross_encoder: the model's local folder, relative to this file (nothing is downloaded).
    source: str | None = None
    #: type llm: the model of ``models:`` that scores.
    model: str | None = None
    #: type cross_encoder: where it runs: auto picks CUDA when present.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: type cross_encoder: (question, passage) pairs scored per forward pass.
    batch_size: PositiveInt = 32

    @model_validator(mode="after")
    def _source_or_model(self) -> RerankerSpec:
        if self.type == "cross_encoder" and not self.source:
            raise ValueError("a cross_encoder reranker needs source: its local sentence-transformers folder")
        if self.type == "llm" and not self.model:
            raise ValueError("an llm reranker needs model: one of this file's models")
        return self


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


class WorkflowsSpec(Strict):
    """Bounds on what pipeline files may ask of the server's workflows."""

    #: The most rounds a repeat: loop may run (each round is a model call or more: this bounds a request's cost).
    max_rounds: int = Field(10, ge=1, le=1000)


class HeaderValue(Strict):
    """A header's value, read when a tool is called: from an environment variable or a secrets file, never
    written in the YAML."""

    #: The environment variable that holds the value.
    env: str | None = None
    #: A file that holds the value (``/run/secrets/orders_token``; trailing newline dropped).
    file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> HeaderValue:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env: (a variable's name) or file: (a secrets file)")
        return self


class McpServerSpec(Strict):
    """An MCP server whose tools ``agent`` steps may run (each step lists the tools it allows)."""

    #: Streamable HTTP: the server's endpoint, e.g. ``http://127.0.0.1:8765/mcp``.
    url: str | None = None
    #: Stdio: the command that starts the server, e.g. ``[python, examples/mcp_orders/server.py]`` (relative
    #: paths from this file's folder).
    command: list[str] | None = Field(None, min_length=1)
    #: With command: the server's environment, beyond PATH and HOME.
    env: dict[str, str] = Field(default_factory=dict)
    #: With url: the header set of ``tool_headers:`` sent to it (the server's credentials, never a caller's).
    headers_from: str | None = None
    #: How long the tools it listed are trusted before they are listed again (0: before every call);
    #: a ``notifications/tools/list_changed`` from the server lists them again at once.
    schema_ttl_s: float = Field(5.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.url is None) == (self.command is None):
            raise ValueError("give exactly one of url: (streamable HTTP) or command: (stdio)")
        if self.headers_from is not None and self.url is None:
            raise ValueError("headers_from: applies to a url: server only")
        return self


class ServerSpec(Strict):
    """``inferline.yaml``: resources shared by every pipeline of one server."""

    #: The models pipelines may name, by name.
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    #: Vector indexes the ``retrieve`` stage may name, by name.
    indexes: dict[IndexName, IndexSpec] = Field(default_factory=dict)
    #: Sentence-embedding models the ``embed`` stage may name, by name (``POST /v1/embeddings``).
    embedding_models: dict[str, EmbeddingModelSpec] = Field(default_factory=dict)
    #: Rerankers the ``retrieve`` stage's ``rerank:`` may name, by name.
    rerankers: dict[str, RerankerSpec] = Field(default_factory=dict)
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
    #: Bounds on pipelines' workflows (loops).
    workflows: WorkflowsSpec = Field(default_factory=WorkflowsSpec)
    #: MCP servers whose tools ``agent`` steps may run, by name (see docs/tools.md).
    mcp_servers: dict[str, McpServerSpec] = Field(default_factory=dict)
    #: Header sets that ``http`` tools (``headers_from:``) and MCP servers send, by name: header -> where its
    #: value is read from.
    tool_headers: dict[str, dict[str, HeaderValue]] = Field(default_factory=dict)
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
    def _mcp_headers_exist(self) -> ServerSpec:
        for name, mcp in self.mcp_servers.items():
            if mcp.headers_from is not None and mcp.headers_from not in self.tool_headers:
                raise ValueError(f"mcp_servers.{name}.headers_from: {mcp.headers_from!r} is not one of "
                                 f"tool_headers: ({', '.join(sorted(self.tool_headers)) or 'none'})")
        return self

    @model_validator(mode="after")
    def _rerankers_models_exist(self) -> ServerSpec:
        for name, reranker in self.rerankers.items():
            if reranker.type == "llm" and reranker.model not in self.models:
                raise ValueError(f"rerankers.{name}.model: {reranker.model!r} is not one of models: "
                                 f"({', '.join(sorted(self.models)) or 'none'})")
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
