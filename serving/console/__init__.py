"""The web console, served by the app under ``/ui``: pipelines and a streaming playground, traces,
the audit explorer for reviewers, and live metrics.

Server-rendered (Jinja templates in ``templates/``), with small hand-written scripts in ``static/``
and nothing fetched from anywhere else. ``create_app`` mounts it with ``ConsolePlugin(state)``.
"""

from serving.console.plugin import Console, ConsolePlugin

__all__ = ["Console", "ConsolePlugin"]
