"""A progress bar on stderr: redrawn in place on a terminal, a line per tenth of the work otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``12/30 [########------------]  9 passed  3 failed  41.2 s``."""

    def __init__(self, total: int, label: str = "", out: TextIO | None = None, width: int = 24):
        self.total, self.label, self.width = total, label, width
        self.out = out if out is not None else sys.stderr
        self.done = self.passed = 0
        self.started = time.monotonic()
        self._is_tty = bool(getattr(self.out, "isatty", lambda: False)())
        self._last_tenth = -1

    def advance(self, passed: bool) -> None:
        self.done += 1
        self.passed += passed
        tenth = self.done * 10 // max(1, self.total)
        if self._is_tty:
            self.out.write("\r" + self._line())
            self.out.flush()
        elif tenth != self._last_tenth or self.done == self.total:
            self._last_tenth = tenth
            self.out.write(self._line() + "\n")
            self.out.flush()

    def close(self) -> None:
        if self._is_tty:
            self.out.write("\n")
            self.out.flush()

    def _line(self) -> str:
        filled = self.done * self.width // max(1, self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        head = f"{self.label} " if self.label else ""
        return (f"{head}{self.done}/{self.total} [{bar}] {self.passed} passed {self.done - self.passed} failed "
                f"{time.monotonic() - self.started:.1f} s")
