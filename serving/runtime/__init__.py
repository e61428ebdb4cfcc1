"""The runtime: the workspace (server config, stage registry, pipeline files) and ``Runtime``, the one
place that opens and closes every resource pipelines run over; ``database``, the one place in serving
that makes a database engine.

May import ``serving.backends`` and below (``serving.config``: the server file), ``pipeline``, ``stages``
and ``store``.
"""
