"""Streaming text helpers: incremental detokenization and stop strings.

Both are plain Python and unit-tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Prompt tokens kept as context for decoding the first generated ones.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of recent tokens each time and emits only what is
    new. A window that ends in U+FFFD is an incomplete multi-byte character: it
    is held back until the following tokens complete it, so a delta never
    splits a character.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()):
        # The prompt's last tokens give the first generated token its context
        # (SentencePiece drops a leading space at the start of a decode).
        self._decode = decode
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (maybe empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back at the end (an unfinished character decodes as U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]


class StopStrings:
    """Finds stop strings in streamed text, including across chunk boundaries.

    Text that could be the start of a stop string is held back until the
    next chunk shows whether it is; :meth:`feed` returns what is safe to send
    and whether a stop string was hit (the stop string itself is not sent).
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        #: The stop string that was hit, once one was.
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [(i, s) for i, s in ((buffer.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buffer[:at], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of *buffer* that begins some stop string."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if stop.startswith(buffer[-size:]):
                    best = size
                    break
        return best
