"""Model forward passes and weight loading. ``load_model`` picks the architecture."""

from serving.engine.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
