"""The web console, served by the app under ``/ui``: pipelines and a streaming playground, traces,
the audit explorer for reviewers, and live metrics.

Server-rendered (Jinja templates in ``templates/``), with small hand-written scripts in ``static/``
and nothing fetched from anywhere else. ``serving.server.create_server`` mounts it with
``ConsolePlugin(state)``.

May import ``serving.http`` and below; not evals, capacity or the CLI.
"""

from serving.console.plugin import ConsolePlugin
from serving.console.state import Console

__all__ = ["Console", "ConsolePlugin"]
