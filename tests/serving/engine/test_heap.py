"""serving/engine/heap.py: the startup heap is frozen while an engine runs, and given back after."""

from __future__ import annotations

import gc
import weakref

from serving.engine.heap import freeze_startup_heap, thaw


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector can free it


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_frozen_objects_leave_the_collectors_sight_until_the_last_thaw():
    before = _Node()
    assert _tracked(before)
    try:
        assert freeze_startup_heap() > 0
        assert not _tracked(before)
        freeze_startup_heap()  # a second engine in the same process
        thaw()
        assert not _tracked(before), "the heap thawed while another engine still holds it"
        after = _Node()
        assert _tracked(after), "objects made after the freeze are collected as always"
    finally:
        thaw()
    assert _tracked(before) and gc.get_freeze_count() == 0


def test_garbage_is_collected_before_the_freeze_not_kept_for_ever():
    garbage = weakref.ref(_Node())  # unreachable at once, but a cycle: alive until a collection
    gc.disable()  # no automatic collection may free it first
    try:
        assert garbage() is not None
        freeze_startup_heap()
        thaw()
    finally:
        gc.enable()
    assert garbage() is None
