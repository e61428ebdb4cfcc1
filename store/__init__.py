"""Storage at the bottom of the stack: the SQL audit store and FAISS vector indexes.

Imports nothing of Inferline's own; ``serving`` wires these into the
protocols of ``pipeline.protocols``.
"""
