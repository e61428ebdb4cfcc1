"""What a value may hold, known at load: the type of a flow field, of a step's output, or of a part of them.

    ValueType.of(int | None)            # a number or null
    ValueType.of(Document)              # a record: id, text, source, title, score
    ValueType.of(Literal["a", "b"])     # a string, one of 'a', 'b'
    ValueType.from_schema({"type": "object", "properties": {"intent": {"enum": ["refund", "tech"]}}})

Made once, from Python annotations (the request context's fields, a stage type's ``Outputs``) and from the
JSON Schemas of structured outputs; read by the checks of ``when:`` expressions (pipeline/exprtypes.py) and of
``steps.ID.FIELD`` references. Nothing else writes a type down a second time as text: messages name a type as
:attr:`ValueType.name` says, which is made from the annotation itself.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: What a value may be, as messages and the expression checker speak of it.
KINDS = ("number", "string", "bool", "null", "list", "mapping", "record")

_SCALARS = {int: "number", float: "number", str: "string", bool: "bool", type(None): "null"}
_SCHEMA_KINDS = {"integer": "number", "number": "number", "string": "string", "boolean": "bool", "null": "null",
                 "array": "list", "object": "record"}


@dataclass(frozen=True, slots=True)
class ValueType:
    """What a value may hold. ``kinds`` None: unknown (anything; nothing about it is checked)."""

    kinds: frozenset[str] | None
    #: The only values it may take (an enum, a ``Literal``), when known.
    values: tuple[Any, ...] | None = None
    #: A record's fields, in order, when known: reading another is an error.
    fields: tuple[tuple[str, ValueType], ...] | None = None
    #: What a list's items hold.
    items: ValueType | None = None
    #: How messages name it (``list[Document]``, ``int | None``).
    name: str = ""

    @classmethod
    def of(cls, annotation: Any) -> ValueType:
        """The type of *annotation* (a class, ``X | None``, ``list[X]``, ``Literal[...]``, a dataclass...)."""
        return _from_python(annotation, ())

    @classmethod
    def from_schema(cls, schema: Any) -> ValueType:
        """The type of the values valid against JSON Schema *schema* (``$ref`` to its own ``$defs`` followed)."""
        return _from_schema(schema, schema if isinstance(schema, dict) else {}, ())

    @classmethod
    def record(cls, fields: Mapping[str, ValueType], name: str = "record") -> ValueType:
        return cls(frozenset({"record"}), fields=tuple(fields.items()), name=name)

    @property
    def is_known(self) -> bool:
        return self.kinds is not None

    def field(self, name: str) -> ValueType | None:
        """The type of field *name* of this record; None when it has no such field (or is no record)."""
        return dict(self.fields).get(name) if self.fields is not None else None

    def field_names(self) -> list[str]:
        return [name for name, _ in self.fields] if self.fields is not None else []

    def optional(self) -> ValueType:
        """This type, or null."""
        if self.kinds is None or "null" in self.kinds:
            return self
        values = None if self.values is None else (*self.values, None)
        return dataclasses.replace(self, kinds=self.kinds | {"null"}, values=values, name=f"{self.name} | None")

    def without_null(self) -> ValueType:
        if self.kinds is None or "null" not in self.kinds or self.kinds == {"null"}:
            return self
        values = None if self.values is None else tuple(v for v in self.values if v is not None)
        return dataclasses.replace(self, kinds=self.kinds - {"null"}, values=values,
                                   name=self.name.removesuffix(" | None"))

    def describe(self) -> str:
        """For a message: ``a string``, ``one of 'refund', 'tech'``, ``a record (id, text)``."""
        if self.values is not None:
            return "one of " + ", ".join(_literal(v) for v in self.values)
        if self.kinds is None:
            return "anything"
        return " or ".join(_WORDS[kind] for kind in KINDS if kind in self.kinds)


_WORDS = {"number": "a number", "string": "a string", "bool": "a boolean", "null": "null", "list": "a list",
          "mapping": "a mapping", "record": "a record"}

#: Anything: nothing about it is known.
UNKNOWN = ValueType(None, name="Any")


def merge(types_: Iterable[ValueType], name: str = "") -> ValueType:
    """A value of any of *types_*: their kinds together; values, fields and items where all know them."""
    given = list(types_)
    if not given or any(t.kinds is None for t in given):
        return dataclasses.replace(UNKNOWN, name=name or "Any")
    kinds = frozenset().union(*(t.kinds for t in given if t.kinds is not None))
    values = None if any(t.values is None for t in given) else tuple(dict.fromkeys(v for t in given for v in t.values
                                                                                   if t.values is not None))
    records = [t for t in given if t.fields is not None]
    fields = None
    if records and len(records) == sum("record" in (t.kinds or ()) for t in given):
        merged: dict[str, list[ValueType]] = {}
        for record in records:
            for field_name, field_type in record.fields or ():
                merged.setdefault(field_name, []).append(field_type)
        fields = tuple((field_name, merge(found)) for field_name, found in merged.items())
    lists = [t.items for t in given if t.items is not None]
    items = merge(lists) if lists and len(lists) == sum("list" in (t.kinds or ()) for t in given) else None
    return ValueType(kinds, values, fields, items, name or " | ".join(dict.fromkeys(t.name for t in given)))


def _from_python(annotation: Any, seen: tuple[Any, ...]) -> ValueType:
    name = type_name(annotation)
    if annotation is Any or annotation is object:
        return dataclasses.replace(UNKNOWN, name=name)
    if annotation in _SCALARS:
        return ValueType(frozenset({_SCALARS[annotation]}), name=name)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        values = tuple(args)
        return ValueType(frozenset(_SCALARS.get(type(v), "string") for v in values), values=values, name=name)
    if origin in (typing.Union, types.UnionType):
        return merge((_from_python(arg, seen) for arg in args), name)
    if origin in (list, tuple, Sequence, typing.Sequence) or annotation in (list, tuple):
        item = _from_python(args[0], seen) if args and args[0] is not Ellipsis else UNKNOWN
        return ValueType(frozenset({"list"}), items=item, name=name)
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        return ValueType(frozenset({"mapping"}), name=name)  # a mapping's keys are the client's: not checked
    if isinstance(annotation, type) and (dataclasses.is_dataclass(annotation) or hasattr(annotation, "model_fields")):
        if annotation in seen:
            return ValueType(frozenset({"record"}), name=name)
        hints = typing.get_type_hints(annotation)
        names = [f.name for f in dataclasses.fields(annotation)] if dataclasses.is_dataclass(annotation) \
            else list(annotation.model_fields)
        return ValueType.record({field: _from_python(hints[field], (*seen, annotation)) for field in names}, name)
    return dataclasses.replace(UNKNOWN, name=name)  # a protocol, a callable, an iterator: opaque to expressions


def _from_schema(schema: Any, root: dict[str, Any], seen: tuple[str, ...]) -> ValueType:
    if not isinstance(schema, dict):
        return UNKNOWN
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        return UNKNOWN if target is None or ref in seen else _from_schema(target, root, (*seen, ref))
    if "const" in schema:
        return _values((schema["const"],))
    if isinstance(schema.get("enum"), list):
        return _values(tuple(schema["enum"]))
    for combined in ("anyOf", "oneOf"):
        if isinstance(schema.get(combined), list):
            return merge(_from_schema(s, root, seen) for s in schema[combined])
    declared = schema.get("type")
    if isinstance(declared, list):
        return merge(_from_schema({**schema, "type": t}, root, seen) for t in declared)
    kind = _SCHEMA_KINDS.get(declared) if isinstance(declared, str) else None
    if kind is None:
        return UNKNOWN
    if kind == "list":
        return ValueType(frozenset({"list"}), items=_from_schema(schema.get("items"), root, seen),
                         name=f"list[{_from_schema(schema.get('items'), root, seen).name or 'Any'}]")
    if kind == "record":
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return ValueType(frozenset({"mapping"}), name="object")
        required = set(schema.get("required") or ())
        return ValueType.record({key: (field if key in required else field.optional())
                                 for key, value in properties.items()
                                 for field in (_from_schema(value, root, seen),)}, "object")
    return ValueType(frozenset({kind}), name=declared)


def _values(values: tuple[Any, ...]) -> ValueType:
    kinds = frozenset("null" if v is None else "bool" if isinstance(v, bool) else _SCALARS.get(type(v), "record")
                      if not isinstance(v, list) else "list" for v in values)
    return ValueType(kinds, values=values, name=" | ".join(_literal(v) for v in values))


def _resolve(root: dict[str, Any], ref: str) -> Any:
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _literal(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value).lower() \
        if isinstance(value, bool) else str(value)


def type_name(annotation: Any) -> str:
    """*annotation* as the code writes it: ``list[Document]``, ``Principal | None``, ``dict[str, Any]``."""
    if annotation is type(None) or annotation is None:
        return "None"
    if annotation is Any:
        return "Any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(_literal(arg) for arg in args) + "]"
    if origin is not None:
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(type_name(arg) for arg in args)}]" if args else base
    return getattr(annotation, "__name__", str(annotation))
