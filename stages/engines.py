"""How stages reach the engine of a model, through ``Resources.engines``."""

from __future__ import annotations

from pipeline.errors import InferlineError
from pipeline.protocols import Engine, Resources


class NoEngine(InferlineError):
    """The pipeline needs a model but the process was started without engines."""

    kind = "no_engine"


async def engine_for(resources: Resources, name: str) -> tuple[str, Engine]:
    """The model's name and engine; an empty *name* means the server's default model."""
    if resources.engines is None:
        raise NoEngine("this process has no model engines; run the pipeline through `inferline run` "
                       "or `inferline serve`")
    name = name or resources.engines.default_model
    return name, await resources.engines.get(name)
