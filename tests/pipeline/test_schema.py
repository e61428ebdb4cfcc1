"""The JSON Schema editors check pipeline files against: shipped, fresh, and as strict as the loader
(the server file's: tests/serving/config/test_schema.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import Field

from pipeline.loader import load_pipeline_text
from pipeline.registry import StageRegistry
from pipeline.schema import DIALECT, dumps, field_notes, pipeline_schema
from pipeline.stage import NoConfig, Stage
from stages import register_builtins

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "pipelines").glob("*.yaml"))
PIPELINE_HEADER = "# yaml-language-server: $schema=../schemas/pipeline.schema.json"


def shipped(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text(encoding="utf-8"))


def problems(schema: dict[str, Any], data: Any) -> list[str]:
    """What a draft-07 validator (an editor's) finds wrong with *data*, as 'path: message'."""
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)]


def pipeline(stage: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"name": "p", **top, "stages": [{"id": "s", **stage}]}


@pytest.fixture(scope="module")
def builtin_schema() -> dict[str, Any]:
    return pipeline_schema(register_builtins(StageRegistry()))


def test_the_shipped_schema_is_fresh(builtin_schema):
    path = ROOT / "schemas" / "pipeline.schema.json"
    assert path.read_text(encoding="utf-8") == dumps(builtin_schema), (
        "schemas/pipeline.schema.json is stale (a spec model or a stage's Config changed): run `make schemas` "
        "(or `inferline schema pipeline --builtin --output schemas/pipeline.schema.json`) and commit it")


def test_the_shipped_schema_is_draft_07():
    schema = shipped("pipeline")
    assert schema["$schema"] == DIALECT
    jsonschema.Draft7Validator.check_schema(schema)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_pipeline_points_at_and_validates_against_the_shipped_schema(path):
    text = path.read_text(encoding="utf-8")
    assert text.splitlines()[0] == PIPELINE_HEADER
    assert problems(shipped("pipeline"), yaml.safe_load(text)) == []


@pytest.mark.parametrize(("data", "where"), [
    (pipeline({"type": "generate", "with": {"max_tokenz": 5}}), "stages.0.with: Additional properties"),
    (pipeline({"type": "retrieve", "with": {"index": "handbook", "top_k": "ten"}}), "stages.0.with.top_k: 'ten'"),
    (pipeline({"type": "generate", "with": {"temperature": -1}}), "stages.0.with.temperature: -1 is less than"),
    (pipeline({"type": "prompt"}, descripton="x"), ": Additional properties are not allowed ('descripton'"),
    (pipeline({"type": "prompt", "wiht": {}}), "stages.0: Additional properties are not allowed ('wiht'"),
    (pipeline({"type": "promtp"}), "stages.0.type: 'promtp' is not one of"),
    (pipeline({"type": "prompt"}, access={"roles": ["callers"]}), "access.roles.0: 'callers' is not one of"),
    ({"name": "p", "stages": []}, "stages: [] should be non-empty"),
])
def test_a_mistake_fails_the_pipeline_schema(builtin_schema, data, where):
    found = problems(builtin_schema, data)
    assert any(where in p for p in found), found


def test_each_type_has_its_own_options(builtin_schema):
    assert problems(builtin_schema, pipeline({"type": "retrieve", "with": {"index": "handbook", "top_k": 2}})) == []
    assert problems(builtin_schema, pipeline({"type": "tokenize", "with": {"top_k": 2}}))  # retrieve's, not its
    assert problems(builtin_schema, pipeline({"type": "score", "with": {}}))  # sample_rate and checks required


def test_shorthands_the_loader_accepts_are_in_the_schema(builtin_schema, registry):
    data = pipeline({"type": "policy", "with": {"pii": "redact", "injection": "flag", "deny": ["credentials"]}})
    assert problems(builtin_schema, data) == []
    load_pipeline_text(yaml.safe_dump(data), "p.yaml", registry)


def described(schema: dict[str, Any]) -> list[str]:
    """Where a property of *schema* has no description ('if' clauses only select, they describe nothing)."""
    missing = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, path)
        if not isinstance(node, dict):
            return
        for key, prop in node.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{path}.{key}")
            walk(prop, f"{path}.{key}")
        for key, value in node.items():
            if key not in ("properties", "if"):
                walk(value, path)

    walk(schema, "")
    return missing


def test_every_option_has_a_description():
    assert described(shipped("pipeline")) == [], "add a #: comment above each of these fields"


class SlugConfig(NoConfig):
    """Options of the slug stage."""

    separator: str = Field("-", description="Put between words.")
    #: Longest slug kept.
    max_length: int = Field(40, ge=1)
    lowercase: bool = True
    """Lowercase the words first."""


class SlugStage(Stage):
    """Turns the input into a URL slug."""

    type_name = "slug"
    Config = SlugConfig


def test_a_plugin_stage_type_is_in_the_schema_with_its_options():
    registry = register_builtins(StageRegistry())
    registry.register(SlugStage)
    schema = pipeline_schema(registry)
    stage = schema["definitions"]["StageSpec"]
    assert "slug" in stage["properties"]["type"]["enum"]
    index = stage["properties"]["type"]["enum"].index("slug")
    assert stage["properties"]["type"]["enumDescriptions"][index] == "Turns the input into a URL slug."
    options = schema["definitions"]["SlugConfig"]["properties"]
    assert {key: prop["description"] for key, prop in options.items()} == {
        "separator": "Put between words.", "max_length": "Longest slug kept.",
        "lowercase": "Lowercase the words first."}
    assert problems(schema, pipeline({"type": "slug", "with": {"max_length": 10}})) == []
    assert problems(schema, pipeline({"type": "slug", "with": {"max_lenght": 10}}))
    assert problems(pipeline_schema(register_builtins(StageRegistry())), pipeline({"type": "slug"}))


def test_field_notes_are_inherited_and_overridden():
    class Base(NoConfig):
        #: The base's.
        a: int = 0
        #: Replaced below.
        b: int = 0

    class Child(Base):
        #: The child's.
        b: int = 0
        c: int = 0  # an ordinary comment is no description

    assert field_notes(Child) == {"a": "The base's.", "b": "The child's."}
