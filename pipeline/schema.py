"""JSON Schemas for editors: the pipeline file's (``inferline schema pipeline``, ``schemas/``), and
:func:`model_schema`, which makes one of any spec model the same way.

Generated from the models that validate the files (:mod:`pipeline.spec` and each registered stage type's
``Config``), so an editor checks what the loader checks: unknown keys, types, ranges. A stage's ``with:``
is chosen by its ``type:`` (one ``if``/``then`` per registered type), and every option carries a
description: its ``Field(description=...)``, else the ``#:`` comment above it or the docstring under it.

A file opts in with its first line::

    # yaml-language-server: $schema=../schemas/pipeline.schema.json

The dialect is draft-07, the newest that VS Code's YAML extension and JetBrains IDEs validate in full.
The loader still checks what a schema cannot (model and index names, ``when:`` expressions, data flow).
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from pipeline.registry import StageRegistry
from pipeline.spec import PipelineSpec

DIALECT = "http://json-schema.org/draft-07/schema#"
_DEFINITIONS = "definitions"


def pipeline_schema(registry: StageRegistry) -> dict[str, Any]:
    """The schema of a pipeline file whose stage types are those of *registry*."""
    types = {name: cls for name in registry.names() if (cls := registry.get(name)) is not None}
    refs, document = _generate([PipelineSpec, *dict.fromkeys(cls.Config for cls in types.values())])
    stage = _definition(document, _definition(document, refs[PipelineSpec])["properties"]["stages"]["items"])
    stage["properties"]["type"] = {
        "description": "The stage type: a built-in one or a plugin the server operator registered.",
        "enum": list(types),
        "enumDescriptions": [_summary(cls) for cls in types.values()],
    }
    stage["allOf"] = [
        {"if": {"properties": {"type": {"const": name}}, "required": ["type"]},
         "then": {"properties": {"with": {**refs[cls.Config], "description": f"Options of the {name} stage."}}}}
        for name, cls in types.items()
    ]
    return _finish(_root(document, refs[PipelineSpec], "Inferline pipeline file"))


def model_schema(model: type[BaseModel], title: str) -> dict[str, Any]:
    """The schema of a file that *model* validates whole, titled *title* (the server file's, say)."""
    refs, document = _generate([model])
    return _finish(_root(document, refs[model], title))


def dumps(schema: dict[str, Any]) -> str:
    """*schema* as the files of ``schemas/`` hold it: JSON indented by 2, one final newline."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def field_notes(cls: type[BaseModel]) -> dict[str, str]:
    """The ``#:`` comment above each field of *cls*, or the docstring under it, by field name (bases too)."""
    notes: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
            notes.update(_own_notes(klass))
    return notes


class _Described(GenerateJsonSchema):
    """Pydantic's generator, with each field's ``#:`` comment as its description and no per-field titles."""

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        json_schema = super().model_schema(schema)
        cls = schema["cls"]
        if "description" in json_schema:  # the class docstring
            json_schema["description"] = _plain(json_schema["description"])
        notes = field_notes(cls)
        properties = json_schema.get("properties", {})
        for name, field in cls.model_fields.items():
            prop = properties.get(field.alias or name)
            if isinstance(prop, dict) and "description" not in prop and name in notes:
                prop["description"] = notes[name]
        return json_schema

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False  # "Max Tokens" above max_tokens says nothing the key does not


def _generate(models: list[type[BaseModel]]) -> tuple[dict[type[BaseModel], dict[str, str]], dict[str, Any]]:
    keyed, document = models_json_schema([(model, "validation") for model in models], by_alias=True,
                                         ref_template=f"#/{_DEFINITIONS}/{{model}}", schema_generator=_Described)
    document = {_DEFINITIONS: document.pop("$defs", {}), **document}
    return {model: ref for (model, _), ref in keyed.items()}, document


def _definition(document: dict[str, Any], ref: dict[str, str]) -> dict[str, Any]:
    """The definition *ref* (``{"$ref": "#/definitions/Name"}``) points to."""
    return document[_DEFINITIONS][ref["$ref"].rsplit("/", 1)[1]]


def _root(document: dict[str, Any], ref: dict[str, str], title: str) -> dict[str, Any]:
    """*document* with the definition *ref* points to as its root."""
    root = _definition(document, ref)
    definitions = {name: value for name, value in document[_DEFINITIONS].items() if value is not root}
    return {"$schema": DIALECT, **root, "title": title, _DEFINITIONS: definitions}


def _finish(node: Any) -> Any:
    """Draft-07 ignores a ``$ref``'s siblings: wrap the reference in ``allOf`` when it has any."""
    if isinstance(node, list):
        return [_finish(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _finish(value) for key, value in node.items()}
    if "$ref" in node and len(node) > 1:
        ref = node.pop("$ref")
        node["allOf"] = [{"$ref": ref}, *node.get("allOf", [])]
    return node


def _summary(cls: type) -> str:
    """A stage type's first docstring paragraph: its class's own, else its module's."""
    doc = cls.__dict__.get("__doc__") or getattr(sys.modules.get(cls.__module__), "__doc__", None)
    return _plain(doc.strip().split("\n\n")[0]) if doc else ""


def _plain(text: str) -> str:
    """reST to what an editor's tooltip shows: one paragraph, single backticks."""
    return " ".join(text.split()).replace("``", "`")


def _own_notes(cls: type) -> dict[str, str]:
    """The notes of the fields *cls* itself declares, read from its source (none when it has no source)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    body = next((node.body for node in ast.parse(source).body if isinstance(node, ast.ClassDef)), [])
    notes = {}
    for index, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        row = node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#:"):
            comment.insert(0, lines[row].lstrip()[2:])
            row -= 1
        after = body[index + 1] if index + 1 < len(body) else None
        docstring = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if comment:
            notes[node.target.id] = _plain(" ".join(comment))
        elif isinstance(docstring, str):
            notes[node.target.id] = _plain(docstring)
    return notes
