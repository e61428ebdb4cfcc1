"""A server process's write-ahead journal of audit records: durable before the response, chained after.

    journal = Journal.open(Path("audit-journal"))   # audit-journal.<pid>-<random>.jsonl, locked by this process
    journal.append([json_line(row, stages), ...])   # one write and one fdatasync for the batch
    ...                                             # the records reach the chain (AuditWriter)
    journal.truncate()                              # nothing journaled is still unwritten
    journal.append(lines, empty_first=True)         # or emptied by the next batch's append
    journal.close()                                 # removes the file when it is empty

The server's audit sink (serving/backends/audit_sink.py) answers a request once its record is here, and
chains the record into the database right after, off the response's path. A crash in between
leaves the record in the file; the next start replays every journal no live process holds
(:func:`leftover_journals`, then ``AuditWriter.replay_file``), skipping ids already chained, so each
record is chained exactly once. The lines have the spool's format (store/audit/spool.py).

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
import threading
from pathlib import Path

SUFFIX = ".jsonl"


class Journal:
    """An append-only file of this process's records that are not yet in the chain.

    While the server runs, the sink calls :meth:`append` and :meth:`truncate` from worker threads, not
    on the event loop (an ``ftruncate`` took 0.5-0.7 ms on ext4 here, once per batch); only its shutdown
    truncates and closes on the loop, after the last request. A lock orders them.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._lock = threading.Lock()
        self._size = 0  # bytes in the file: this process is its only writer
        self._appends = 0  # batches appended so far

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

    @property
    def appends(self) -> int:
        """How many batches were appended so far (for :meth:`truncate`)."""
        return self._appends

    def append(self, lines: list[str], *, empty_first: bool = False) -> None:
        """Write *lines* (each ending in a newline) and wait until the disk has them. *empty_first*: every
        line already in the file is chained, so the file is emptied first. On an error (a full disk) the
        file is cut back to where it was, so no torn line is left for the next append to follow."""
        data = "".join(lines).encode()
        with self._lock:
            if self._fd < 0:
                raise OSError(errno.EBADF, f"audit journal {self.path} is closed")
            if empty_first:
                self._empty()
            start, view = self._size, memoryview(data)
            try:
                while view:
                    view = view[os.write(self._fd, view):]
                os.fdatasync(self._fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                with contextlib.suppress(OSError):  # where the cut failed, what the file really holds
                    self._size = os.fstat(self._fd).st_size
                raise
            self._size = start + len(data)
            self._appends += 1

    def truncate(self, appends: int | None = None) -> None:
        """Empty the file: every record in it is in the chain (appends go on at the new end). *appends*:
        only if no batch was appended since :attr:`appends` was that, for a truncate that waits for a
        thread while the next batch may be appended. No system call when the file is empty."""
        with self._lock:
            if self._fd >= 0 and (appends is None or appends == self._appends):
                self._empty()

    def _empty(self) -> None:
        if self._size:
            os.ftruncate(self._fd, 0)
            self._size = 0

    def size(self) -> int:
        return self._size

    def close(self) -> None:
        """Release the file; remove it when empty (else the next start replays it)."""
        with self._lock:
            if self._fd < 0:
                return
            try:
                if self._size == 0:
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
