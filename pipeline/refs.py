"""Typed references from a stage's config to server resources.

A stage config field typed :data:`ModelRef` or :data:`IndexRef` (or a list of
them) is checked by the loader against ``inferline.yaml``'s ``models:`` and
``indexes:``, so every stage type gets "unknown model 'bgi'; did you mean
'big'?" without writing the check itself::

    class Config(NoConfig):
        default: ModelRef
        fallback: list[ModelRef] = []
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class Ref:
    """Marks a string field as naming a resource of *kind* (``model`` or ``index``)."""

    kind: str


ModelRef = Annotated[str, Ref("model")]
IndexRef = Annotated[str, Ref("index")]
EmbeddingModelRef = Annotated[str, Ref("embedding_model")]
RerankerRef = Annotated[str, Ref("reranker")]


def find_refs(config: BaseModel, loc: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str, str]]:
    """Yield ``(loc, kind, name)`` for every reference inside *config*."""
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        key = info.alias or name
        ref = _ref_of(info.metadata) or _optional_ref(info.annotation)
        if ref is not None and isinstance(value, str):
            yield (*loc, key), ref.kind, value
        elif isinstance(value, list):
            inner = _list_ref(info.annotation)
            for index, item in enumerate(value):
                if inner is not None and isinstance(item, str):
                    yield (*loc, key, index), inner.kind, item
                elif isinstance(item, BaseModel):
                    yield from find_refs(item, (*loc, key, index))
        elif isinstance(value, BaseModel):
            yield from find_refs(value, (*loc, key))


def _ref_of(metadata: list[Any]) -> Ref | None:
    return next((m for m in metadata if isinstance(m, Ref)), None)


def _optional_ref(annotation: Any) -> Ref | None:
    """The Ref of ``ModelRef | None`` (pydantic keeps the metadata inside the union)."""
    for arg in get_args(annotation):
        if get_origin(arg) is Annotated:
            ref = _ref_of(list(get_args(arg)[1:]))
            if ref is not None:
                return ref
    return None


def _list_ref(annotation: Any) -> Ref | None:
    if get_origin(annotation) is not list:
        return None
    (item,) = get_args(annotation)
    return _ref_of(list(get_args(item)[1:])) if get_origin(item) is Annotated else None
