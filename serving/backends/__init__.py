"""What stages reach through ``pipeline.protocols``: the model pool with its local, remote and Ray
engines, replica placement, the tokenizer, indexes, response caches and the audit sink.

May import ``serving.config`` (the server file's models they are built from), ``serving.engine``, ``pipeline``
and ``store``; nothing else of serving.
"""
