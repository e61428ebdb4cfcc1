"""One gate for pipeline files that serve together: ``inferline validate``, ``inferline serve`` and the hot reload.

    pipelines = PipelineSet.load(workspace.load_pipeline, pipeline_files(workspace.pipelines_dir)).checked()

A set holds each file loaded (YAML, stages, options, models, ``when:``: pipeline/loader.py), and every issue
of the set, located in its file: a file that does not load, two pipelines of one ``name:`` (it is their
endpoint), and a reference from one pipeline to another that does not resolve. The references are kinds
(:data:`REFERENCES`), each one function from the set to its issues: a ``score`` stage's judges, a
``pipeline`` step's callee, an ``agent`` step's pipeline tools. A new kind of reference between pipelines is
one more function there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.diagnostics import suggest
from pipeline.errors import SpecError, SpecIssue
from pipeline.loader import LoadedPipeline, name_clash
from pipeline.yamlsrc import format_loc, parse

#: What a pipeline file's name ends with.
PIPELINE_SUFFIXES = (".yaml", ".yml")

#: A place in a pipeline file, as ``("stages", 2, "with", "pipeline")``.
Loc = tuple[str | int, ...]


def pipeline_files(folder: Path) -> list[Path]:
    """The pipeline files of *folder*, sorted: its ``*.yaml`` and ``*.yml`` (none when it is not a folder)."""
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir() if path.suffix in PIPELINE_SUFFIXES and not path.is_dir())


def declared_names(files: Iterable[Path]) -> dict[Path, str]:
    """Each of *files* with the ``name:`` it declares, read without loading it (its file name's stem when it has
    none that can be read)."""
    names = {}
    for path in files:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            data = None
        names[path] = data["name"] if isinstance(data, dict) and isinstance(data.get("name"), str) else path.stem
    return names


@dataclass(slots=True)
class PipelineSet:
    """Pipelines that serve together, and every issue of the set (see the module docstring).

    *beside* names the pipelines served beside the set without being in it (what ``inferline validate``
    checks a few files against: the pipelines folder); a reference may resolve to one of them.
    """

    #: The pipelines that loaded, in the order of their files.
    pipelines: list[LoadedPipeline]
    #: Every located issue: files that do not load, names used twice, references that do not resolve.
    issues: list[SpecIssue] = field(default_factory=list)
    #: Files that could not be read at all, with why (their issue, at line 1, is in :attr:`issues` too).
    unreadable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, load: Callable[[Path], LoadedPipeline], files: Iterable[Path],
             beside: Collection[str] = ()) -> PipelineSet:
        """Each of *files* loaded by *load* (``Workspace.load_pipeline``), then the set checked."""
        loaded: list[LoadedPipeline] = []
        issues: list[SpecIssue] = []
        unreadable: dict[str, str] = {}
        for path in files:
            try:
                loaded.append(load(path))
            except SpecError as exc:
                issues += exc.issues
            except OSError as exc:
                unreadable[str(path)] = why = f"cannot read: {exc.strerror or exc}"
                issues.append(SpecIssue(str(path), 1, 1, "", why))
        checked = cls.of(loaded, beside)
        return cls(checked.pipelines, issues + checked.issues, unreadable)

    @classmethod
    def of(cls, loaded: Sequence[LoadedPipeline], beside: Collection[str] = ()) -> PipelineSet:
        """The set of pipelines already loaded, checked: unique names, then every kind of reference."""
        issues: list[SpecIssue] = []
        by_name: dict[str, LoadedPipeline] = {}
        for pipeline in loaded:
            earlier = by_name.setdefault(pipeline.spec.name, pipeline)
            if earlier is not pipeline and not _same_file(earlier, pipeline):
                issues.append(name_clash(pipeline, earlier))
        names = {*by_name, *beside}
        for references in REFERENCES:
            issues += references(by_name, names)
        return cls(list(loaded), issues)

    def checked(self) -> list[LoadedPipeline]:
        """The pipelines; :class:`SpecError` with every issue when there is one."""
        if self.issues:
            raise SpecError(self.issues)
        return self.pipelines

    def issues_of(self, file: str | Path) -> list[SpecIssue]:
        """The issues located in *file*."""
        return [issue for issue in self.issues if issue.file == str(file)]

    def loaded_from(self, file: str | Path) -> LoadedPipeline | None:
        """The pipeline *file* loaded as, if it loaded."""
        return next((pipeline for pipeline in self.pipelines if pipeline.file == str(file)), None)


def _same_file(one: LoadedPipeline, other: LoadedPipeline) -> bool:
    """Whether two pipelines were loaded from one file (a file named twice is no clash)."""
    return Path(one.file).resolve() == Path(other.file).resolve()


# -- references between pipelines ------------------------------------------------------------------------
# Each kind: (the set's pipelines by name, every name a reference may resolve to) -> its issues.


def judges(pipelines: dict[str, LoadedPipeline], names: set[str]) -> list[SpecIssue]:
    """A ``score`` stage's judges are pipelines served beside it, never the pipeline itself."""
    return _served_not_self(pipelines, names, "score", "a pipeline cannot judge itself")


def callees(pipelines: dict[str, LoadedPipeline], names: set[str]) -> list[SpecIssue]:
    """A ``pipeline`` step's callee is served beside it, and no pipeline calls itself, directly or through
    others (a request would never end)."""
    issues = []
    for item in pipelines.values():
        for loc, target in _references(item, "pipeline"):
            if target not in names:
                issues.append(_locate(item, loc, _not_served(target, names)))
            elif (cycle := _path_back(pipelines, target, item.spec.name)) is not None:
                issues.append(_locate(item, loc, f"pipeline {item.spec.name!r} would call itself: "
                                                 f"{' -> '.join([item.spec.name, *cycle])}"))
    return issues


def tool_pipelines(pipelines: dict[str, LoadedPipeline], names: set[str]) -> list[SpecIssue]:
    """An ``agent`` step's ``pipeline`` tools are pipelines served beside it, never the pipeline itself (a model
    could call it again and again)."""
    return _served_not_self(pipelines, names, "agent", "a pipeline cannot be a tool of its own agent step")


def _served_not_self(pipelines: dict[str, LoadedPipeline], names: set[str], stage_type: str,
                     itself: str) -> list[SpecIssue]:
    """Each pipeline its *stage_type* stages name is served beside it, and is not itself (*itself* says why)."""
    issues = []
    for item in pipelines.values():
        for loc, target in _references(item, stage_type):
            if target == item.spec.name:
                issues.append(_locate(item, loc, itself))
            elif target not in names:
                issues.append(_locate(item, loc, _not_served(target, names)))
    return issues


#: Every kind of reference between pipelines the set checks.
REFERENCES: tuple[Callable[[dict[str, LoadedPipeline], set[str]], list[SpecIssue]], ...] = (
    judges, callees, tool_pipelines)


def _references(item: LoadedPipeline, stage_type: str) -> Iterator[tuple[Loc, str]]:
    """The pipelines *item*'s stages of *stage_type* name (``Stage.calls``), each with its place in the file."""
    for index, plan in enumerate(item.plans):
        if plan.spec.type == stage_type:
            for loc, target in plan.cls.calls(plan.config):
                yield ("stages", index, "with", *loc), target


def _path_back(pipelines: dict[str, LoadedPipeline], start: str, goal: str) -> list[str] | None:
    """The names from *start* to *goal* through ``pipeline`` steps (*start* and *goal* included), if *goal*
    can be reached; depth first, each pipeline visited once."""
    stack, seen = [[start]], {start}
    while stack:
        path = stack.pop()
        if path[-1] == goal:
            return path
        callee = pipelines.get(path[-1])
        for _, target in _references(callee, "pipeline") if callee is not None else ():
            if target == goal or target not in seen:
                seen.add(target)
                stack.append([*path, target])
    return None


def _not_served(target: str, names: set[str]) -> str:
    known = sorted(names)
    return f"no pipeline {target!r} is served beside it{suggest(target, known)} (pipelines: {', '.join(known)})"


def _locate(item: LoadedPipeline, loc: Loc, message: str) -> SpecIssue:
    """*message* at *loc* of *item*'s text (the text it was loaded from: a deploy's may not be on disk yet)."""
    text = item.text
    if not text:
        try:
            text = Path(item.file).read_text(encoding="utf-8")
        except OSError:
            text = ""
    src, _ = parse(item.file, text) if text else (None, [])
    return src.issue(loc, message) if src is not None else SpecIssue(item.file, 1, 1, format_loc(loc), message)
