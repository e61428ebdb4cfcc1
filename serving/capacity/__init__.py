"""Capacity: workloads, the load generator (``inferline load``), engine step profiles (``inferline profile``)
and the planner (``inferline plan``).

May import ``serving.http`` and below; not the console, evals or the CLI.
"""
