"""The JSON Schema of the server file, ``inferline schema server`` and ``schemas/server.schema.json``.

Generated as the pipeline file's is (:mod:`pipeline.schema`: descriptions from each field's ``#:``
comment, draft-07), from :class:`~serving.config.server.ServerSpec`. ``inferline.yaml`` opts in with
its first line::

    # yaml-language-server: $schema=schemas/server.schema.json
"""

from __future__ import annotations

from typing import Any

from pipeline.schema import model_schema
from serving.config.server import ServerSpec


def server_schema() -> dict[str, Any]:
    """The schema of the server file, ``inferline.yaml``."""
    return model_schema(ServerSpec, "Inferline server file (inferline.yaml)")
