"""Start-up measurements kept between processes.

The engine measures two choices on the machine at start-up (``kernel_calibration.py`` measures; this module
keeps the answers): how many rows go to our small-batch kernel before oneDNN
(:func:`~serving.engine.kernel_calibration.calibrate_small_rows`, about 5 s for SmolLM2-135M's layers on 2
cores) and whether decode's matmuls prefetch for themselves
(:func:`~serving.engine.kernel_calibration.calibrate_burst`). Both are the machine's, not the process's, so each is
measured once and kept in ``$INFERLINE_CALIBRATION_CACHE`` (default ``~/.cache/inferline/calibration.json``):
a restart, a second replica or ``inferline run`` reads it back in a millisecond instead of measuring again,
and every process on the machine chooses the same kernels (which the capacity planner relies on).

An entry's key is a hash of all a measurement depends on: the kernels' build (their sources, torch's version and
the CPU's instruction set: :func:`serving.engine.kernels.build_key`), the CPU's model name
(:func:`serving.engine.kernels.cpu_model`), the number of
threads, the weights' shapes and the question's own arguments. Another machine, a new kernel build or a
different thread count therefore measures afresh. ``INFERLINE_CALIBRATION_CACHE=off`` measures at every
start and keeps nothing; deleting the file measures again once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from serving.engine.kernels import build_key, cpu_model

log = logging.getLogger(__name__)

T = TypeVar("T", int, bool)
ENV = "INFERLINE_CALIBRATION_CACHE"
OFF = frozenset({"off", "0", "none", "false"})
_VERSION = 1
_lock = threading.Lock()
#: This process's answers, by key string, whatever the file holds: one measurement per process at most.
_memory: dict[str, int | bool] = {}


def cache_file() -> Path | None:
    """The file measurements are kept in, or None when ``$INFERLINE_CALIBRATION_CACHE`` turns it off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    return Path(value) if value else Path.home() / ".cache" / "inferline" / "calibration.json"


def remembered(question: str, key: tuple, measure: Callable[[], T]) -> tuple[T, Path | None]:
    """The answer to *question* for *key* on this machine, and the cache file it was read from: None when
    this process measured it (now, by ``measure()``, or at an earlier call)."""
    cpu = cpu_model()
    full = hashlib.sha256(json.dumps([question, build_key(), cpu, *key], default=str).encode()).hexdigest()[:24]
    with _lock:
        if full in _memory:
            return _memory[full], None  # type: ignore[return-value]
    path = cache_file()
    kept = _read(path).get(full) if path else None
    if kept is not None and isinstance(kept.get("value"), int | bool):
        value, source = kept["value"], path
    else:
        value, source = measure(), None
        if path:
            _write(path, full, {"question": question, "cpu": cpu, "value": value})
    with _lock:
        _memory.setdefault(full, value)
        return _memory[full], source  # type: ignore[return-value]


def forget() -> None:
    """Drop this process's answers (tests; the file is left as it is)."""
    with _lock:
        _memory.clear()


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("calibration cache %s is unreadable (%s): measuring again", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _write(path: Path, key: str, entry: dict) -> None:
    """Add one entry: read, merge, write a temporary file and rename it over the old one, so that a reader
    never sees half a file (two processes writing at once may each keep only their own entry: then the other
    is measured again next time, nothing worse)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read(path)
        entries[key] = {**entry, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump({"version": _VERSION, "entries": entries}, out, indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: measure at every start, as before
        log.warning("calibration cache %s could not be written (%s); set %s=off to stop trying", path, exc, ENV)
