"""Load ``inferline.yaml`` with located errors, and the catalog of names its pipelines may use.

    server = load_server("inferline.yaml")
    loaded = load_pipeline("pipelines/rag.yaml", registry, catalog_of(server))
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from pipeline.diagnostics import validation_issues
from pipeline.errors import SpecError
from pipeline.loader import read_text
from pipeline.protocols import Catalog, ModelInfo, RerankerInfo
from pipeline.yamlsrc import parse
from serving.config.server import ServerSpec


def load_server(path: str | Path) -> ServerSpec:
    """Load ``inferline.yaml``; raises :class:`SpecError` with every problem."""
    file = str(path)
    src, issues = parse(file, read_text(path))
    if src is None or issues:
        raise SpecError(issues)
    data = {} if src.data is None else src.data
    if not isinstance(data, dict):
        raise SpecError([src.issue((), "expected a mapping of settings (models:, database:, ...)")])
    try:
        return ServerSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(validation_issues(src, exc, ServerSpec, data)) from None


def catalog_of(server: ServerSpec) -> Catalog:
    """The names pipelines may refer to, from the server config: all the core sees of it."""
    models = {
        name: ModelInfo(name, spec.price.to_price(), spec.context_window)
        for name, spec in server.models.items()
    }
    embedding_models = {name: ModelInfo(name, spec.price.to_price())
                        for name, spec in server.embedding_models.items()}
    index_fields = {name: dict(spec.metadata) for name, spec in server.indexes.items()}
    rerankers = {name: RerankerInfo(name, spec.type, spec.model or "") for name, spec in server.rerankers.items()}
    return Catalog(models=models, indexes=frozenset(server.indexes), index_fields=index_fields, rerankers=rerankers,
                   embedding_models=embedding_models, max_rounds=server.workflows.max_rounds,
                   mcp_servers=frozenset(server.mcp_servers), tool_headers=frozenset(server.tool_headers))
