"""The pipeline core: YAML specs and loader, stages, context, runner, tracing, cost.

Imports nothing else of Inferline's; ``stages`` and ``serving`` build on it.
"""

from __future__ import annotations

__version__ = "0.1.0"
