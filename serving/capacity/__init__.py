"""Capacity: workloads, the load generator (``inferline load``), engine step profiles (``inferline profile``)
and the planner (``inferline plan``).

May import ``serving.runtime`` and below; not the HTTP app (import-linter's capacity contract), the console,
evals or the CLI.
"""
