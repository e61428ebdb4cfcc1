"""A server process's write-ahead journal of audit records: durable before the response, chained after.

    journal = Journal.open(Path("audit-journal"))   # audit-journal.<pid>-<random>.jsonl, locked by this process
    journal.append([json_line(row, stages), ...])   # one write and one fdatasync for the batch
    ...                                             # the records reach the chain (AuditStore)
    journal.truncate()                              # nothing journaled is still unwritten
    journal.close()                                 # removes the file when it is empty

The server's audit sink (serving/audit_sink.py) answers a request once its record is here, and
chains the record into the database right after, off the response's path. A crash in between
leaves the record in the file; the next start replays every journal no live process holds
(:func:`leftover_journals`, then ``AuditStore.replay_file``), skipping ids already chained, so each
record is chained exactly once. The lines have the spool's format (store/audit_spool.py).

Each process has its own file (its pid and a random part in the name) and holds an exclusive
``flock`` on it while it runs, so processes that share a config folder never write to one file,
and a journal whose lock can be taken belongs to a process that is gone. Replaying is idempotent
(ids already chained are skipped), so two processes starting together and replaying the same
leftover chain each record once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
from pathlib import Path

SUFFIX = ".jsonl"


class Journal:
    """An append-only file of this process's records that are not yet in the chain."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._dirty = False  # appended to since the last truncate

    @classmethod
    def open(cls, prefix: Path) -> Journal:
        """This process's journal, ``<prefix>.<pid>-<random>.jsonl``, created and locked. Raises OSError.
        The random part keeps names unique where pids repeat (containers sharing a volume are all pid 1)."""
        path = prefix.with_name(f"{prefix.name}.{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        return cls(path, fd)

    def append(self, lines: list[str]) -> None:
        """Write *lines* (each ending in a newline) and wait until the disk has them. On an error (a full
        disk) the file is cut back to where it was, so no torn line is left for the next append to
        follow."""
        if self._fd < 0:
            raise OSError(errno.EBADF, f"audit journal {self.path} is closed")
        start = os.fstat(self._fd).st_size
        view = memoryview("".join(lines).encode())
        try:
            self._dirty = True
            while view:
                view = view[os.write(self._fd, view):]
            os.fdatasync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def truncate(self) -> None:
        """Empty the file: every record in it is in the chain (appends go on at the new end). No system
        call when nothing was appended since the last time (the sink asks before every batch)."""
        if self._fd >= 0 and self._dirty:
            os.ftruncate(self._fd, 0)
            self._dirty = False

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        """Release the file; remove it when empty (else the next start replays it)."""
        if self._fd < 0:
            return
        try:
            if self.size() == 0:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # releases the lock
            self._fd = -1


def leftover_journals(prefix: Path) -> list[Path]:
    """Journals under *prefix* that no running process holds (their writer is gone), oldest first."""
    found = []
    name = re.compile(re.escape(prefix.name) + r"\.\d+-[0-9a-f]+" + re.escape(SUFFIX))
    for path in prefix.parent.glob(f"{prefix.name}.*{SUFFIX}"):
        if not name.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile (another process replayed it)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mtime = os.fstat(fd).st_mtime
        except OSError:
            continue  # a live process's
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            found.append((mtime, path))
        finally:
            os.close(fd)
    return [path for _, path in sorted(found)]
