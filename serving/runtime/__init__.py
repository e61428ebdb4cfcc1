"""The runtime: the server file's settings, the workspace (config, stage registry, pipeline files) and
``Runtime``, the one place that opens and closes every resource pipelines run over.

May import ``serving.backends`` and below, ``pipeline``, ``stages`` and ``store``.
"""
