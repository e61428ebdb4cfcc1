"""The local spool: audit records that could not reach the database, one JSON line each.

A line is the normalized record with its id and stages but no seq, hash or
prev_hash: those are assigned when the record is replayed into the chain.
Appends are flushed and fsynced before ``write`` returns; an exclusive
``flock`` keeps an append and a replay-then-truncate in another process
from interleaving.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Spool:
    """An append-only JSON-lines file of records waiting for the database."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def is_empty(self) -> bool:
        """True when nothing waits; one ``stat``, cheap enough to ask on every write."""
        try:
            return not self.path.is_file() or self.path.stat().st_size == 0
        except OSError:
            return True

    def is_writable(self) -> bool:
        """Whether an append could succeed now (the file, or its folder, is writable)."""
        if self.path.exists():
            return self.path.is_file() and os.access(self.path, os.W_OK)
        folder = self.path.parent
        while not folder.exists():
            folder = folder.parent
        return folder.is_dir() and os.access(folder, os.W_OK)

    def append(self, line: str) -> None:
        """Append one line durably. Raises OSError when the disk refuses."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked("a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    @contextlib.contextmanager
    def claimed(self) -> Iterator[list[dict[str, Any]]]:
        """The spooled records, locked; truncated when the block exits without an exception."""
        if self.is_empty():
            yield []
            return
        with self._locked("r+") as handle:
            records = list(_parse(handle.read(), self.path))
            yield records
            handle.seek(0)
            handle.truncate()
            handle.flush()
            os.fsync(handle.fileno())

    def reject(self, record: dict[str, Any], reason: str) -> None:
        """Set a spooled record that can never be inserted aside, next to the spool."""
        logger.error("audit spool %s: record %s rejected (%s)", self.path, record.get("id"), reason)
        _reject(self.path, json.dumps(record, separators=(",", ":"), default=str))

    @contextlib.contextmanager
    def _locked(self, mode: str) -> Iterator[Any]:
        with open(self.path, mode, encoding="utf-8") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield handle
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _parse(text: str, path: Path) -> Iterator[dict[str, Any]]:
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                # No newline after it: a write torn by a crash, never acknowledged to its caller.
                logger.warning("audit spool %s: dropping a torn last line", path)
                continue
            _reject(path, line)
            continue
        if isinstance(record, dict):
            yield record
        else:
            _reject(path, line)


def _reject(path: Path, line: str) -> None:
    # Kept aside, never silently dropped: someone has to look at it.
    logger.error("audit spool %s: unreadable line moved to %s.rejected", path, path.name)
    with open(path.with_name(path.name + ".rejected"), "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
