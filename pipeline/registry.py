"""The stage registry: short type names to stage classes.

Built-in stages register by short name (``stages.register_builtins``). The
server operator adds others in two ways, both decided by the operator, never
by a pipeline file:

* an entry point in the group ``inferline.stages`` whose name is the type name
  and whose value is the class (``mystage = "mypkg.stages:MyStage"``);
* ``plugins:`` in ``inferline.yaml``: ``"mypkg.stages"`` imports the module and
  calls its ``register(registry)``; ``"mypkg.stages:MyStage"`` registers one class.

A pipeline's ``type:`` is only ever looked up here, so editing YAML never
imports code.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

from pipeline.context import FIELDS
from pipeline.errors import PluginError
from pipeline.stage import Stage

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "inferline.stages"


class StageRegistry:
    """Maps stage type names to :class:`Stage` subclasses."""

    def __init__(self) -> None:
        self._types: dict[str, type[Stage]] = {}

    def register(self, cls: type[Stage], name: str | None = None) -> type[Stage]:
        """Register *cls* under *name* (default: ``cls.type_name``); returns *cls*."""
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            raise PluginError(f"{cls!r} is not a subclass of pipeline.stage.Stage")
        type_name = name or cls.type_name
        if not type_name:
            raise PluginError(f"{cls.__qualname__} has no type_name; pass name=")
        unknown = sorted((cls.reads | cls.writes) - FIELDS.keys())
        if unknown:
            raise PluginError(f"{cls.__qualname__} declares unknown context fields {unknown}; "
                              f"known: {sorted(FIELDS)}")
        existing = self._types.get(type_name)
        if existing is not None and existing is not cls:
            raise PluginError(f"stage type {type_name!r} is already registered "
                              f"by {existing.__module__}.{existing.__qualname__}")
        if not cls.type_name:
            cls.type_name = type_name
        self._types[type_name] = cls
        return cls

    def get(self, name: str) -> type[Stage] | None:
        return self._types.get(name)

    def names(self) -> list[str]:
        return sorted(self._types)

    def providers(self, field: str) -> list[str]:
        """Type names of the stages that write *field*."""
        return sorted(name for name, cls in self._types.items() if field in cls.writes)

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Register every stage class advertised under the entry-point *group*."""
        for point in entry_points(group=group):
            try:
                cls = point.load()
            except Exception as exc:
                raise PluginError(f"entry point {point.name} = {point.value!r} failed to load: {exc}") from exc
            self.register(cls, point.name)
            logger.info("registered stage type %r from entry point %s", point.name, point.value)

    def load_plugins(self, plugins: list[str]) -> None:
        """Register the operator's ``plugins:`` (module names or ``module:Class``)."""
        for plugin in plugins:
            module_name, _, attr = plugin.partition(":")
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                raise PluginError(f"plugin {plugin!r}: cannot import {module_name!r}: {exc}") from exc
            if attr:
                cls = getattr(module, attr, None)
                if cls is None:
                    raise PluginError(f"plugin {plugin!r}: module {module_name!r} has no {attr!r}")
                self.register(cls)
            elif callable(getattr(module, "register", None)):
                module.register(self)
            else:
                raise PluginError(f"plugin {plugin!r}: module has no register(registry) function; "
                                  f"name a class instead, as '{module_name}:ClassName'")
            logger.info("loaded plugin %s", plugin)
