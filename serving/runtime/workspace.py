"""Wire the layers together: server config, stage registry and pipeline files."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.errors import InvalidInput, SpecError, SpecIssue
from pipeline.loader import LoadedPipeline, load_pipeline, load_pipeline_text
from pipeline.registry import StageRegistry
from serving.config.environment import apply_environment
from serving.config.loader import catalog_of, load_server
from serving.config.server import ServerSpec
from serving.runtime.pipeline_set import PIPELINE_SUFFIXES, PipelineSet, declared_names, pipeline_files
from stages import register_builtins

DEFAULT_CONFIG = "inferline.yaml"


@dataclass(slots=True)
class Workspace:
    """A server config, its registry, and where its pipelines live."""

    server: ServerSpec
    registry: StageRegistry
    root: Path

    @property
    def pipelines_dir(self) -> Path:
        return self.root / self.server.pipelines

    @property
    def database_url(self) -> str:
        """``database:``, with a relative SQLite path taken from the config file's folder."""
        url = self.server.database
        prefix = "sqlite:///"
        if url.startswith(prefix) and not url.startswith(prefix + "/") and url != prefix + ":memory:":
            return prefix + str((self.root / url[len(prefix):]).resolve())
        return url

    def load_pipeline(self, path: str | Path) -> LoadedPipeline:
        # A pipeline's own output: is compiled as the engines would, here at load, so that a broken one
        # never reaches a request (where it would read as the caller's mistake).
        return load_pipeline(path, self.registry, replace(catalog_of(self.server), check_output=_compile_error))

    def load_pipeline_text(self, text: str, file: str) -> LoadedPipeline:
        """A pipeline from its YAML *text* (a deploy through the API), checked as :meth:`load_pipeline` does;
        *file* is the name its errors carry."""
        catalog = replace(catalog_of(self.server), check_output=_compile_error)
        return load_pipeline_text(text, file, self.registry, catalog)

    def load_pipelines(self) -> list[LoadedPipeline]:
        """Every pipeline of the pipelines folder, checked as a set (serving/runtime/pipeline_set.py); the issues
        of all files together in one SpecError."""
        return PipelineSet.load(self.load_pipeline, pipeline_files(self.pipelines_dir)).checked()

    def resolve(self, pipeline: str) -> Path:
        """A pipeline given as a file path, or one of the pipelines folder by its file name or its ``name:``."""
        candidate = Path(pipeline)
        if candidate.suffix in PIPELINE_SUFFIXES or candidate.exists():
            return candidate
        declared = declared_names(pipeline_files(self.pipelines_dir))
        matches = [path for path, name in declared.items() if pipeline in (path.stem, name)]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(f"{name} ({path.name})" if name != path.stem else name
                          for path, name in declared.items()) or "none"
        if matches:
            raise InvalidInput(f"pipeline {pipeline!r} is ambiguous in {self.pipelines_dir}: "
                               + " and ".join(f"{path.name} (name: {declared[path]})" for path in matches)
                               + "; give the file's path instead")
        raise FileNotFoundError(f"no pipeline {pipeline!r}: not a file, and no pipeline of {self.pipelines_dir} "
                                f"has that file name or name: (there: {known})")


def build_registry(server: ServerSpec) -> StageRegistry:
    """Built-in stages, then entry points, then the operator's ``plugins:``."""
    registry = register_builtins(StageRegistry())
    registry.load_entry_points()
    registry.load_plugins(server.plugins)
    return registry


def open_workspace(config: str | None = None) -> Workspace:
    """Load *config* (default: ``$INFERLINE_CONFIG``, else ./inferline.yaml if present)."""
    path = config or os.environ.get("INFERLINE_CONFIG")
    if path is None and Path(DEFAULT_CONFIG).exists():
        path = DEFAULT_CONFIG
    if path is None:
        server, root = ServerSpec(), Path(".")
    elif not Path(path).exists():
        raise SpecError([SpecIssue(str(path), 1, 1, "", "server config file not found")])
    else:
        server, root = load_server(path), Path(path).parent
    server = apply_environment(server)
    return Workspace(server, build_registry(server), root)


def _compile_error(kind: str, value: object) -> str | None:
    """:func:`serving.engine.constraints.compile_error`, imported when a pipeline first declares an ``output:``
    (llguidance brings transformers and torch: seconds that ``inferline keys`` or ``--help`` need not pay)."""
    from serving.engine.constraints import compile_error

    return compile_error(kind, value)
