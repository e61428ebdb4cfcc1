"""Turn pydantic validation errors into located, human-worded spec issues.

``1 validation error for PipelineSpec ... Input should be a valid integer``
becomes ``pipelines/rag.yaml:14:5: stages[2].with.top_k: expected an integer,
got 'ten'``, and an unknown key suggests the closest valid name.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from pipeline.errors import SpecIssue
from pipeline.yamlsrc import Loc, YamlSource

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def suggest(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` when some choice is close to *word*, else ``''``."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def validation_issues(src: YamlSource, exc: ValidationError, model: type[BaseModel],
                      data: Any, prefix: Loc = ()) -> list[SpecIssue]:
    """One :class:`SpecIssue` per error in *exc*, located in *src*.

    *data* is what was validated and *prefix* where it sits in the file, so the
    same function serves the whole file and a stage's ``with:`` block.
    """
    issues = []
    for error in exc.errors(include_url=False):
        loc = _data_loc(data, error["loc"])
        kind = error["type"]
        if kind == "extra_forbidden":
            names = _field_names(model, loc[:-1], data)
            message = f"unknown key {loc[-1]!r}{suggest(str(loc[-1]), names)}"
            if names:
                message += f" (allowed: {', '.join(names)})"
            issues.append(src.issue((*prefix, *loc), message, at_key=True))
        elif kind == "missing":
            issues.append(src.issue((*prefix, *loc), f"missing required key {loc[-1]!r}" if loc
                                    else "missing required key"))
        else:
            issues.append(src.issue((*prefix, *loc), _message(error)))
    return issues


def _message(error: dict[str, Any]) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "spec_hint":  # pipeline.spec.hint: written to be shown as it is
        return error["msg"]
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_show(value)}"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return f"expected one of {expected}, got {_show(value)}"
    if kind == "union_tag_invalid":  # a discriminated union (a list of typed checks, say)
        ctx = error.get("ctx", {})
        return f"unknown type {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
    if kind == "string_pattern_mismatch":
        return (f"{_show(value)} is not a valid name: use lowercase letters, digits, '-' and '_', "
                f"starting with a letter")
    text = error["msg"]
    text = text[0].lower() + text[1:] if text else kind
    return f"{text.removeprefix('input ').removeprefix('value error, ')}, got {_show(value)}"


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return repr(value)


def _data_loc(data: Any, loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    """Drop the steps pydantic adds for union members, keeping only real data steps."""
    out: list[str | int] = []
    current = data
    for step in loc:
        if _has(current, step):
            current = current[step]
            out.append(step)
        elif isinstance(current, dict) and current.get("type") == step:
            continue  # a discriminated union's tag: not a step into the data
        elif isinstance(current, dict) and not isinstance(step, int):
            out.append(step)  # a missing or unknown key: the last real step
            break
    return tuple(out)


def _has(container: Any, step: Any) -> bool:
    if isinstance(container, dict):
        return step in container
    return isinstance(container, list) and isinstance(step, int) and 0 <= step < len(container)


def _field_names(model: type[BaseModel], loc: Loc, data: Any = None) -> list[str]:
    target = _model_at(model, loc, data)
    if target is None:
        return []
    return [info.alias or name for name, info in target.model_fields.items()]


def _model_at(model: type[BaseModel], loc: Loc, data: Any = None) -> type[BaseModel] | None:
    tp: Any = model
    steps = [data]
    for step in loc:
        steps.append(steps[-1][step] if _has(steps[-1], step) else None)
    for step, here in zip(loc, steps, strict=False):
        tp = _unwrap(tp, here)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = {(info.alias or name): info for name, info in tp.model_fields.items()}
            if step not in fields:
                return None
            tp = fields[step].annotation
        elif get_origin(tp) in (list, dict):
            tp = get_args(tp)[-1]
        else:
            return None
    tp = _unwrap(tp, steps[-1])
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any, data: Any = None) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        return _unwrap(get_args(tp)[0], data)
    if origin in (Union, types.UnionType):
        tag = data.get("type") if isinstance(data, dict) else None
        for arg in get_args(tp):  # the member a discriminated union's tag picks
            field = arg.model_fields.get("type") if isinstance(arg, type) and issubclass(arg, BaseModel) else None
            if tag is not None and field is not None and tag in get_args(field.annotation):
                return arg
        for arg in get_args(tp):
            inner = _unwrap(arg)
            if (isinstance(inner, type) and issubclass(inner, BaseModel)) or get_origin(inner) in (list, dict):
                return inner
    return tp
