"""The engine's own errors (it imports nothing of ours; ``serving`` maps them)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's errors."""


class InvalidRequest(EngineError, ValueError):
    """A request's prompt or sampling parameters are invalid; nothing was queued."""


class EngineOverloaded(EngineError):
    """The waiting queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class EngineStopped(EngineError):
    """The engine was shut down, or its loop died; the request did not finish."""


class EngineDeadlineExceeded(EngineError):
    """The request was still waiting for admission at its deadline; it was dropped before prefill."""
