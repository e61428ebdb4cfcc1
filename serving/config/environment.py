"""The server file's settings overridden from the environment, and secrets read from files.

Here beside the file's models because each variable is named after a setting's path in them
(``serving.runtime.workspace`` applies it after ``load_server``).

Every setting can be overridden by an environment variable named after its
path: ``INFERLINE_DATABASE``, ``INFERLINE_HTTP__PORT`` (or the short forms
``INFERLINE_HOST`` / ``INFERLINE_PORT``), ``INFERLINE_AUTH__ENABLED``,
``INFERLINE_TELEMETRY__EXPORTER``... A variable ending in ``_FILE`` reads the
value from that file instead (``INFERLINE_DATABASE_FILE=/run/secrets/db``), so
secrets such as a database password need not sit in the YAML or the
environment. ``INFERLINE_CONFIG`` names the YAML file itself; the few other
``INFERLINE_*`` variables that are not settings are :data:`NOT_SETTINGS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.errors import SpecError, SpecIssue
from serving.config.server import ServerSpec

PREFIX = "INFERLINE_"
#: Short names kept for the settings people set most.
ALIASES = {"HOST": "HTTP__HOST", "PORT": "HTTP__PORT"}
#: ``INFERLINE_*`` variables that are not settings: the YAML file's own name, the engine's process knobs
#: (``serving/engine``: kernels, caches, start-up measurements) and the client commands' defaults
#: (``inferline load``, ``replay``, ``pipelines``). A server started where one is exported serves as usual.
NOT_SETTINGS = frozenset({"CONFIG", "KERNELS", "KERNEL_CACHE", "GGUF_CACHE", "CALIBRATION_CACHE", "SMALL_ROWS",
                          "PANEL_BURST", "POOL_SPIN_US", "API_KEY", "URL", "METRICS_KEY"})


def apply_environment(server: ServerSpec, environ: Mapping[str, str] | None = None) -> ServerSpec:
    """*server* with every ``INFERLINE_*`` override applied (validated like the YAML)."""
    environ = os.environ if environ is None else environ
    data = server.model_dump(mode="json")
    texts: dict[tuple[str, ...], str] = {}  # each override's path and its text as written
    for name, raw in sorted(environ.items()):
        if not name.startswith(PREFIX):
            continue
        key = name[len(PREFIX):]
        if key.endswith("_FILE"):
            key, raw = key[:-5], _read_secret(name, raw)
        key = ALIASES.get(key, key)
        if key in NOT_SETTINGS:
            continue
        path = [part.lower() for part in key.split("__")]
        # YAML scalars, so that "8001" is a number, "false" a boolean and "[a, b]" a list.
        _set(data, path, yaml.safe_load(raw) if raw.strip() else raw, name)
        texts[tuple(path)] = raw
    if not texts:
        return server
    try:
        return ServerSpec.model_validate(data)
    except ValidationError as exc:
        # YAML read a value as a number or a boolean where the setting is text (a key of digits only,
        # "INFERLINE_AUDIT__CHECKPOINT_KEY=0123"): such a value is taken as written, and validated again.
        retry = [tuple(str(part) for part in error["loc"]) for error in exc.errors() if error["type"] == "string_type"]
        if not any(loc in texts for loc in retry):
            raise
        for loc in retry:
            if loc in texts:
                _set(data, list(loc), texts[loc], PREFIX + "__".join(loc).upper())
        return ServerSpec.model_validate(data)


def _set(data: dict[str, Any], path: list[str], value: Any, variable: str) -> None:
    node = data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            raise SpecError([SpecIssue(variable, 1, 1, "", f"no setting {'.'.join(path)!r} to override")])
        node = node[part]
    if path[-1] not in node:
        raise SpecError([SpecIssue(variable, 1, 1, "", f"no setting {'.'.join(path)!r} to override")])
    node[path[-1]] = value


def _read_secret(variable: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SpecError([SpecIssue(variable, 1, 1, "", f"cannot read {path}: {exc.strerror}")]) from None
