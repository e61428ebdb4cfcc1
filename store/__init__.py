"""Storage at the bottom of the stack: SQL (engines, API keys, counters, pipeline versions, and the audit log,
``store.audit``, a package behind its facade) and FAISS vector indexes.

Imports nothing of Inferline's own; ``serving`` wires these into the
protocols of ``pipeline.protocols``.
"""
