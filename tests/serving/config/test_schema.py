"""The JSON Schema editors check ``inferline.yaml`` against: shipped, fresh, and as strict as the loader."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipeline.schema import DIALECT, dumps
from serving.config.schema import server_schema
from tests.pipeline.test_schema import described, problems

ROOT = Path(__file__).parents[3]
SHIPPED = ROOT / "schemas" / "server.schema.json"
SERVER_HEADER = "# yaml-language-server: $schema=schemas/server.schema.json"


def test_the_shipped_schema_is_fresh():
    assert SHIPPED.read_text(encoding="utf-8") == dumps(server_schema()), (
        "schemas/server.schema.json is stale (a model of serving/config changed): run `make schemas` "
        "(or `inferline schema server --output schemas/server.schema.json`) and commit it")


def test_the_shipped_schema_is_draft_07_and_described():
    schema = json.loads(SHIPPED.read_text(encoding="utf-8"))
    assert (schema["$schema"], schema["title"]) == (DIALECT, "Inferline server file (inferline.yaml)")
    jsonschema.Draft7Validator.check_schema(schema)
    assert described(schema) == [], "add a #: comment above each of these fields"


def test_the_server_file_points_at_and_validates_against_the_shipped_schema():
    text = (ROOT / "inferline.yaml").read_text(encoding="utf-8")
    assert text.splitlines()[0] == SERVER_HEADER
    assert problems(json.loads(SHIPPED.read_text(encoding="utf-8")), yaml.safe_load(text)) == []


@pytest.mark.parametrize(("data", "where"), [
    ({"databse": "sqlite:///x.db"}, ": Additional properties are not allowed ('databse'"),
    ({"models": {"smol": {"source": "m", "kv_cache": {"blok_size": 8}}}}, "models.smol.kv_cache: Additional"),
    ({"models": {"smol": {"source": "m", "device": "gpu"}}}, "models.smol.device: 'gpu' is not one of"),
    ({"http": {"port": 70000}}, "http.port: 70000 is greater than"),
])
def test_a_mistake_fails_the_server_schema(data, where):
    found = problems(server_schema(), data)
    assert any(where in p for p in found), found
