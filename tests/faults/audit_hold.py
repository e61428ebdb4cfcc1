"""A fault for the fault tests only: the server journals its audit records but never chains them.

Listed under ``plugins:`` by a test's own ``inferline.yaml`` (like engine_fault.py; no shipped config
names it, and it lives outside the installed packages). Loaded, it puts the chaining of journaled
records (serving/backends/audit_sink.py) an hour after each batch, so every answered request's record stays
in the process's journal only: a server that dies now is one that died between answering and
chaining, which is what the journal's replay at the next start must cover.
"""

from __future__ import annotations

from typing import Any

HOLD_S = 3600.0


def register(registry: Any) -> None:
    """Plugin entry point: delay the audit sink's chaining (registers no stage type)."""
    from serving.backends import audit_sink

    audit_sink.DRAIN_DELAY_S = HOLD_S
