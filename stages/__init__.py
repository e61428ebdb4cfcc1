"""Built-in stage types, one module each; a new type is one module plus one line below."""

from __future__ import annotations

from pipeline.registry import StageRegistry
from stages.prompt import PromptStage

BUILTIN_STAGES = (PromptStage,)


def register_builtins(registry: StageRegistry) -> StageRegistry:
    """Register every built-in stage type on *registry*; returns it."""
    for cls in BUILTIN_STAGES:
        registry.register(cls)
    return registry
