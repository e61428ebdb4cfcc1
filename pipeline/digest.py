"""What a step read and gave, as JSON and as a SHA-256: the audit record's per-step hashes and values, which
tell a replay which steps a candidate changes and let it reuse the others' outputs.

    digest({"input": "Hi", "steps.classify.output": {"intent": "tech"}})   # -> 64 hex characters

Dataclasses become objects, tuples and sets lists (sets sorted), floats keep their repr; what has no JSON form
(a token stream, a filter) is named by its type, so its hash says only that it was there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

#: The types JSON holds as they are: a value of exactly one of these needs no walk.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def jsonable(value: Any) -> Any:
    """*value* as plain JSON values."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list or kind is tuple:  # the common case: a prompt's token ids, a list of texts
        return list(value) if all(type(item) in _SCALARS for item in value) else [jsonable(item) for item in value]
    if kind is dict:
        return {key if type(key) is str else str(key): jsonable(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(item) for item in value), key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, BaseModel):
        return jsonable(value.model_dump(mode="json", by_alias=True))
    return f"<{type(value).__name__}>"


def canonical(value: Any) -> str:
    """*value* as canonical JSON: sorted keys, no whitespace, non-ASCII as is."""
    return json.dumps(jsonable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def digest(value: Any) -> str:
    """The SHA-256 of *value*'s canonical JSON."""
    return hashlib.sha256(canonical(value).encode()).hexdigest()
