"""The garbage collector and a serving process's long-lived heap.

Once a model is loaded the process holds a great many objects the collector tracks (torch,
transformers, the tokenizer's Python side, pydantic models, the app), nearly all of them there for
the process's whole life. CPython's collection of its oldest generation walks every one with the GIL
held, so the event loop and the engine's step both stand still while it runs (docs/engine.md, "The
garbage collector"). ``gc.freeze()`` moves what exists at that moment into a permanent generation
that collections skip; vLLM does the same once its engine has started. Objects made later are
collected as always, and ``thaw`` gives the frozen ones back to the collector (a process that starts
and stops many engines, as a test run does, collects them then).
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


def freeze_startup_heap() -> int:
    """Collect, then freeze every object the collector tracks; the number frozen. Counted: the heap
    thaws at the last matching :func:`thaw`."""
    global _holders
    with _lock:
        _holders += 1
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def thaw() -> None:
    """The end of one :func:`freeze_startup_heap`; the last one gives the frozen objects back."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()
