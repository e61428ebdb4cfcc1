"""The documents under a folder, as an index reads them: text, title, pages and typed metadata.

Metadata comes from a Markdown file's YAML front matter and from ``metadata.json`` files: one in a folder
maps the names of files in that folder (or below it, as relative paths) to their metadata; front matter
wins where both name a key. Fields the index declares (``indexes.NAME.metadata`` in ``inferline.yaml``)
are typed: ``string``, ``number``, ``date`` (kept as ``YYYY-MM-DD``) or ``list`` (of strings); a value
that does not fit its type skips the document with a reason, as a broken PDF does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any, Literal

from store.readers import SUFFIXES, Unreadable, read_file

FieldType = Literal["string", "number", "date", "list"]
FIELD_TYPES: tuple[str, ...] = ("string", "number", "date", "list")
#: Fields every document has, whatever the index declares.
BUILTIN_FIELDS: dict[str, FieldType] = {"doc_id": "string", "path": "string", "title": "string"}
SIDECAR = "metadata.json"


@dataclass(slots=True)
class Document:
    doc_id: str
    path: str
    title: str
    text: str
    sha256: str
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Where each page starts in ``text`` (PDF); empty for formats without pages.
    pages: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Scan:
    """What a folder gave: its documents, sorted by path, and the files skipped with the reason."""

    documents: list[Document]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: The folder paths are relative to (the file's own folder when one file was read).
    base: Path = Path(".")


def read_documents(root: Path, fields: Mapping[str, str] | None = None) -> Scan:
    """Every readable file under *root* (or *root* itself); ids are paths without their suffix.

    Raises FileNotFoundError when no file has a suffix the index reads, ValueError when two files would
    have the same id (``guide.md`` and ``guide.pdf``).
    """
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and
                                                 p.suffix.lower() in SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no {', '.join(SUFFIXES)} files under {root}")
    base = root.parent if root.is_file() else root
    sidecars = _sidecars(base, files)
    scan, seen = Scan([], base=base), {}
    for path in files:
        rel = path.relative_to(base).as_posix()
        doc_id = rel.rsplit(".", 1)[0]
        if doc_id in seen:
            raise ValueError(f"{seen[doc_id]} and {rel} would both be document {doc_id!r}: rename one")
        seen[doc_id] = rel
        try:
            scan.documents.append(read_document(path, rel, fields or {}, sidecars.get(rel, {})))
        except Unreadable as exc:
            scan.skipped.append((rel, str(exc)))
    return scan


def read_document(path: Path, rel: str, fields: Mapping[str, str], extra: Mapping[str, Any]) -> Document:
    """One file as a document: *extra* is its ``metadata.json`` entry; raises :class:`Unreadable`."""
    data = path.read_bytes()
    parsed = read_file(path)
    metadata = typed_metadata({**extra, **parsed.metadata}, fields)
    digest = hashlib.sha256(data)
    if metadata:  # a metadata change is a change, even when the file's bytes are the same
        digest.update(json.dumps(metadata, sort_keys=True).encode())
    title = parsed.title or path.stem.replace("-", " ").replace("_", " ")
    return Document(rel.rsplit(".", 1)[0], rel, title, parsed.text, digest.hexdigest(), metadata, parsed.pages)


def typed_metadata(raw: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """*raw* with each declared field converted to its type (JSON values: dates as ISO strings); raises
    :class:`Unreadable` naming a value that does not fit."""
    out = {}
    for key, value in raw.items():
        if key in BUILTIN_FIELDS:
            raise Unreadable(f"metadata {key!r} is a built-in field (doc_id, path, title): rename it")
        kind = fields.get(key)
        try:
            out[key] = _json(value) if kind is None else coerce(value, kind)
        except (TypeError, ValueError) as exc:
            raise Unreadable(f"metadata {key!r}: {exc}") from None
    return out


def coerce(value: Any, kind: str) -> Any:
    """*value* as a field of type *kind*; raises ValueError saying what was expected."""
    if kind == "list":
        items = value if isinstance(value, list) else [value]
        return [coerce(item, "string") for item in items]
    if isinstance(value, bool) or value is None or isinstance(value, dict | list):
        raise ValueError(f"expected a {kind}, got {value!r}")
    if kind == "string":
        return value.isoformat() if isinstance(value, date) else str(value)
    if kind == "number":
        if isinstance(value, int | float):
            return value
        try:
            number = float(str(value))
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
        return int(number) if number.is_integer() and "." not in str(value) else number
    if kind == "date":
        if isinstance(value, datetime):
            return value.date().isoformat()
        if isinstance(value, date):
            return value.isoformat()
        try:
            return datetime.fromisoformat(str(value)).date().isoformat()
        except ValueError:
            raise ValueError(f"expected a date (YYYY-MM-DD), got {value!r}") from None
    raise ValueError(f"unknown field type {kind!r} (one of {', '.join(FIELD_TYPES)})")


def _json(value: Any) -> Any:
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _sidecars(base: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    """Each file's entry in the ``metadata.json`` files from *base* down to its folder (the nearest wins)."""
    folders = {f for p in files for f in [p.parent, *p.parent.parents] if f == base or base in f.parents}
    found: dict[str, dict[str, Any]] = {}
    for folder in sorted(folders, key=lambda f: len(f.parts)):  # deeper folders last: they win
        sidecar = folder / SIDECAR
        if not sidecar.is_file():
            continue
        try:
            entries = json.loads(sidecar.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{sidecar}: not valid JSON ({exc})") from None
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            raise ValueError(f"{sidecar}: expected an object of file names to metadata objects")
        for name, metadata in entries.items():
            found[(folder / name).relative_to(base).as_posix()] = metadata
    return found


__all__ = ["BUILTIN_FIELDS", "FIELD_TYPES", "SIDECAR", "Document", "Scan", "coerce", "read_document",
           "read_documents", "typed_metadata"]
