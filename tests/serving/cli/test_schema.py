"""``inferline schema``: valid JSON Schema on stdout or into a file, with the server's plugin stage types."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from serving.cli.main import main

ROOT = Path(__file__).parents[3]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)


@pytest.mark.parametrize("name", ["pipeline", "server"])
def test_prints_a_valid_schema(capsys, name):
    assert main(["schema", name]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["additionalProperties"] is False


def test_the_pipeline_schema_has_each_stage_type(capsys):
    assert main(["schema", "pipeline", "--builtin"]) == 0
    printed = capsys.readouterr().out
    assert printed == (ROOT / "schemas" / "pipeline.schema.json").read_text(encoding="utf-8")
    types = json.loads(printed)["definitions"]["StageSpec"]["properties"]["type"]["enum"]
    assert {"prompt", "generate", "stream", "audit"} <= set(types)


def test_includes_the_operators_plugins(tmp_path, capsys):
    config = tmp_path / "inferline.yaml"
    config.write_text("plugins: ['tests.fakes:EchoStage']\n")
    assert main(["schema", "pipeline", "--config", str(config)]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "echo" in schema["definitions"]["StageSpec"]["properties"]["type"]["enum"]
    assert "chunks" in schema["definitions"]["EchoConfig"]["properties"]
    assert main(["schema", "pipeline", "--config", str(config), "--builtin"]) == 0
    assert "echo" not in capsys.readouterr().out


def test_writes_a_file(tmp_path, capsys):
    target = tmp_path / "server.schema.json"
    assert main(["schema", "server", "--output", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == (ROOT / "schemas" / "server.schema.json").read_text(encoding="utf-8")
    captured = capsys.readouterr()
    assert captured.out == "" and f"wrote {target}" in captured.err


def test_a_broken_plugin_is_an_error(tmp_path, capsys):
    config = tmp_path / "inferline.yaml"
    config.write_text("plugins: ['no_such_module_here']\n")
    assert main(["schema", "pipeline", "--config", str(config)]) == 1
    assert "no_such_module_here" in capsys.readouterr().err
