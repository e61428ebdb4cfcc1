"""The manual cannot drift from the code: every example in README.md and docs/*.md loads as Inferline
reads it, and every relative link resolves.

Each fenced ``yaml`` block is recognised by its top-level keys and goes through the loader of its file:

- a pipeline (``name:``, ``stages:``, ``slo:``…): the pipeline loader, with this project's
  inferline.yaml and stage registry, as ``inferline validate`` loads it (judges included);
- a list of stages (``- {id: …, type: …}``): the same, once the stages a pipeline needs around them
  (prompt, tokenize, generate, stream) are added where they are missing;
- a server file (``models:``, ``database:``…): ``serving.config.loader.load_server``;
- one model's settings (``source:``, ``kv_cache:``…): the same, as ``models: {example: …}``;
- a workload (``pipeline:``, ``rates:``…): ``serving.capacity.workload.load_workload``.

A block that is deliberately a fragment says so on its first line, ``# fragment: why``, and is only
parsed as YAML; one that shows a mistake says ``# invalid: why`` and must fail to load; a block that
is neither loadable nor marked fails. A ``json`` block that is an
evaluation case goes through ``serving.evals.dataset.load_dataset``; a ``python`` block compiles, and
one that defines ``register(registry)`` registers its stage types.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from pipeline.errors import SpecError, SpecIssue
from pipeline.registry import StageRegistry
from pipeline.spec import PipelineSpec
from serving.capacity.workload import WorkloadSpec, load_workload
from serving.config.loader import load_server
from serving.config.models import ModelSpec
from serving.config.server import ServerSpec
from serving.evals.dataset import EvalCase, load_dataset
from serving.runtime.pipeline_set import PipelineSet
from serving.runtime.workspace import Workspace, open_workspace
from stages import register_builtins

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = re.compile(r"#\s*fragment:\s*\S")
INVALID = re.compile(r"#\s*invalid:\s*\S")
OPENING = re.compile(r"^ *```(\w*)\s*$")
CLOSING = re.compile(r"^ *```\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: its page, the line of its opening fence, its language and text."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    start, lang = None, ""
    for number, line in enumerate(lines, start=1):
        if start is None and (opening := OPENING.match(line)):
            start, lang = number, opening.group(1)
        elif start is not None and CLOSING.match(line):
            yield Block(page, start, lang, textwrap.dedent("\n".join(lines[start:number - 1])) + "\n")
            start = None


BLOCKS = [block for page in PAGES for block in code_blocks(page)]


def examples(*langs: str) -> list[Any]:
    return [pytest.param(block, id=block.id) for block in BLOCKS if block.lang in langs]


@pytest.fixture(scope="module")
def workspace() -> Workspace:
    """This project's server config and stage registry, as ``inferline validate`` opens them."""
    return open_workspace(str(ROOT / "inferline.yaml"))


@pytest.fixture(scope="module")
def served(workspace: Workspace) -> list[str]:
    """The names of the pipelines the project serves, beside which an example is served (its judges)."""
    return [pipeline.spec.name for pipeline in workspace.load_pipelines()]


def test_the_pages_have_examples():
    langs = [block.lang for block in BLOCKS]
    assert langs.count("yaml") >= 10, "the YAML examples were not found: did the fence syntax change?"


@pytest.mark.parametrize("block", examples("yaml", "yml"))
def test_yaml_example_loads(block: Block, workspace: Workspace, served: list[str], tmp_path: Path):
    data = yaml.safe_load(block.text)
    first = block.text.lstrip()
    if FRAGMENT.match(first):
        return  # a fragment says so; parsing it was the whole check
    kind = kind_of(data)
    if kind is None:
        pytest.fail(f"{block.id}: this example is none of Inferline's files (a pipeline, a list of stages, a "
                    f"server file, a model's settings, a workload): keys {sorted(_keys(data))}. Make it one, "
                    f"or mark it on its first line: '# fragment: what it is'", pytrace=False)
    problem = None
    try:
        LOADERS[kind](block, data, Context(workspace, served, tmp_path))
    except SpecError as exc:
        problem = (str(exc).replace(str(tmp_path / block.page.stem) + ".yaml", block.id.partition(":")[0])
                   .replace(str(tmp_path / "assembled.yaml"), "(assembled)"))
    if INVALID.match(first):
        assert problem, f"{block.id}: marked '# invalid:', but this {kind} example loads"
    elif problem:
        pytest.fail(f"{block.id}: this {kind} example does not load:\n{problem}", pytrace=False)


@pytest.mark.parametrize("block", examples("json"))
def test_json_example_loads(block: Block, tmp_path: Path):
    data = json.loads(block.text)
    if isinstance(data, dict) and "checks" in data and _keys(data) <= _fields(EvalCase):
        dataset = tmp_path / "example.jsonl"
        dataset.write_text(json.dumps(data) + "\n", encoding="utf-8")
        try:
            load_dataset(dataset)
        except SpecError as exc:
            problem = str(exc)
        else:
            return
        pytest.fail(f"{block.id}: this evaluation case does not load:\n{problem}", pytrace=False)


@pytest.mark.parametrize("block", examples("python"))
def test_python_example_compiles(block: Block):
    code = compile(block.text, block.id, "exec")
    if "def register(registry)" in block.text:  # a plugin: its stage types must register
        namespace: dict[str, Any] = {"__name__": "docs_example"}
        exec(code, namespace)  # our own manual's example, run to check that it registers
        registry = register_builtins(StageRegistry())
        before = set(registry.names())
        namespace["register"](registry)
        assert set(registry.names()) > before, f"{block.id}: register() added no stage type"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    broken = []
    for line, target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.relative_to(ROOT)}:{line}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{page.relative_to(ROOT)}:{line}: {target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


REPO_PATH = re.compile(r"`((?:pipeline|stages|serving|store|pipelines|schemas|bench|evals|docs|tests|scripts|"
                       r"workloads)/[\w./-]*)[^`]*`")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_repository_files_exist(page: Path):
    """A file or folder of this repository named in backquotes (`serving/engine/config.py`) exists."""
    missing = []
    for number, line in enumerate(_prose(page), start=1):
        for path in REPO_PATH.findall(line):
            if not (ROOT / path.rstrip(".")).exists():
                missing.append(f"{page.relative_to(ROOT)}:{number}: `{path}` does not exist")
    assert not missing, "\n".join(missing)


# What each kind of example is loaded as.

@dataclass(frozen=True, slots=True)
class Context:
    workspace: Workspace
    served: list[str]
    tmp_path: Path


def _keys(data: Any) -> set[str]:
    return set(data) if isinstance(data, dict) else set()


def _fields(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def _is_stage_list(data: Any) -> bool:
    return isinstance(data, list) and bool(data) and all(isinstance(s, dict) and "type" in s for s in data)


def kind_of(data: Any) -> str | None:
    if _is_stage_list(data):
        return "stages"
    keys = _keys(data)
    if not keys:
        return None
    for kind, model in (("pipeline", PipelineSpec), ("server", ServerSpec), ("model", ModelSpec),
                        ("workload", WorkloadSpec)):
        if keys <= _fields(model):
            return kind
    return None


def _padded(block: Block, at: Context, text: str | None = None) -> Path:
    """The example in a file of its own, its lines where they are on the page (so are errors' lines);
    or, given *text* assembled around it, that text in ``assembled.yaml``."""
    if text is not None:
        file = at.tmp_path / "assembled.yaml"
        file.write_text(text, encoding="utf-8")
        return file
    file = at.tmp_path / (block.page.stem + ".yaml")
    file.write_text("\n" * block.line + block.text, encoding="utf-8")
    return file


def load_pipeline_example(block: Block, data: dict[str, Any], at: Context) -> None:
    if {"name", "stages"} <= data.keys():
        file = _padded(block, at)
    else:  # pipeline keys without a whole pipeline (slo:, access:): in the smallest pipeline there is
        whole = {"name": "example", **data, "stages": data.get("stages") or [{"id": "prompt", "type": "prompt"}]}
        file = _padded(block, at, yaml.safe_dump(whole, sort_keys=False))
    _load(at, file)


# The stages a pipeline needs around a list of stages, and the order built-in stage types go in.
ORDER = ["policy", "retrieve", "route", "prompt", "tokenize", "cache", "generate", "stream", "score", "audit"]
AROUND = {"prompt": {"id": "around-prompt", "type": "prompt"},
          "tokenize": {"id": "around-tok", "type": "tokenize"},
          "generate": {"id": "around-gen", "type": "generate", "with": {"max_tokens": 16}},
          "stream": {"id": "around-out", "type": "stream"}}


def load_stages_example(block: Block, data: list[dict[str, Any]], at: Context) -> None:
    types = [stage["type"] for stage in data]
    others = [stage for stage in data if stage["type"] not in ORDER]
    stages = [stage for kind in ORDER
              for stage in ([s for s in data if s["type"] == kind] or ([AROUND[kind]] if kind in AROUND else []))]
    whole = {"name": "example", "stages": stages + others}
    text = yaml.safe_dump(whole, sort_keys=False)
    try:
        _load(at, _padded(block, at, text))
    except SpecError as exc:  # its lines are those of the assembled pipeline: show it
        shown = SpecIssue(block.id.partition(":")[0], block.line, 1, "",
                          f"the stages ({', '.join(types)}) as they were loaded:\n{text}")
        raise SpecError([*exc.issues, shown]) from None


def _load(at: Context, file: Path) -> None:
    """As ``inferline validate`` loads a file: the workspace's loader, then beside the pipelines served (the
    judges and sub-pipelines it calls)."""
    PipelineSet.load(at.workspace.load_pipeline, [file], beside=at.served).checked()


def load_server_example(block: Block, data: dict[str, Any], at: Context) -> None:
    load_server(_padded(block, at))


def load_model_example(block: Block, data: dict[str, Any], at: Context) -> None:
    load_server(_padded(block, at, yaml.safe_dump({"models": {"example": data}}, sort_keys=False)))


def load_workload_example(block: Block, data: dict[str, Any], at: Context) -> None:
    load_workload(_padded(block, at))


LOADERS = {"pipeline": load_pipeline_example, "stages": load_stages_example, "server": load_server_example,
           "model": load_model_example, "workload": load_workload_example}


# Links and headings.

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose(page: Path) -> list[str]:
    """The page's lines with fenced blocks blanked (line numbers kept)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    fenced = {number for block in code_blocks(page)
              for number in range(block.line, block.line + block.text.count("\n") + 2)}
    return ["" if number in fenced else line for number, line in enumerate(lines, start=1)]


def links(page: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of each relative link outside code."""
    for number, line in enumerate(_prose(page), start=1):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                yield number, target


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings."""
    seen: dict[str, int] = {}
    for line in _prose(page):
        if heading := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)
