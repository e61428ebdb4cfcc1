"""Start a task's coroutine now, in the caller's step: Python 3.12's eager tasks, on 3.11.

``asyncio.create_task`` runs nothing until the event loop reaches the new task at the back of its ready
queue. When a burst of requests arrives together, that queue holds every other request's HTTP handling,
so each request's pipeline would start only after all of them had been parsed. :func:`start_eagerly`
creates the task, then runs its coroutine at once, up to its first real wait (for the chat pipeline:
the engine's first token), as ``asyncio.eager_task_factory`` does: in the task's own context, with the
task as ``current_task()`` (``asyncio.timeout`` cancels that task, not the caller). When the loop reaches
the task, it takes up the wait the coroutine stopped at.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def start_eagerly(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task running *coro*, which has already run up to its first wait (or to its end)."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    started = _Started(coro)
    task = loop.create_task(started, context=context)  # type: ignore[arg-type]
    caller = asyncio.current_task(loop)
    swap_current_task(loop, caller, task)
    try:
        context.run(started.start)
    finally:
        swap_current_task(loop, task, caller)
    return task


def finished_eagerly(task: asyncio.Task[Any]) -> bool:
    """Whether *task*'s coroutine, started by :func:`start_eagerly`, already returned during its start: its work
    is done, and only the loop's first step of the task, which ends it, is left. (One that raised is not:
    waiting for its task raises it.)"""
    coro = task.get_coro()
    return isinstance(coro, _Started) and isinstance(coro._outcome, StopIteration)


def swap_current_task(loop: asyncio.AbstractEventLoop, leaving: asyncio.Task | None,
                      entering: asyncio.Task | None) -> None:
    """Make *entering* the loop's ``current_task()`` in place of *leaving* (None: no task).

    The one use of asyncio's private functions in the project: Python 3.11 has no public way to run a step
    of a task's coroutine outside the loop's own step. It goes when the project moves to Python 3.12, whose
    ``asyncio.eager_task_factory`` (or ``asyncio.Task(..., eager_start=True)``) replaces
    :func:`start_eagerly` altogether. asyncio raises RuntimeError if *leaving* is not the current task.
    """
    if leaving is not None:
        asyncio.tasks._leave_task(loop, leaving)
    if entering is not None:
        asyncio.tasks._enter_task(loop, entering)


class _Started(Coroutine[Any, Any, Any]):
    """*coro*, stepped once by :meth:`start` before its task first steps it.

    The task's first ``send`` hands it what the coroutine waits on, if that is still pending (the
    future, with its ``_asyncio_future_blocking`` flag still set), so that the task attaches to it;
    otherwise (done already, or a bare yield) the coroutine resumes. A cancellation thrown in before
    then reaches the coroutine where it waits, as with ``create_task``; a coroutine that ended
    during :meth:`start` ends its task the same way."""

    __slots__ = ("_coro", "_first", "_outcome", "_waiting")

    def __init__(self, coro: Coroutine[Any, Any, Any]):
        self._coro = coro
        self._first = True
        self._waiting: Any = None
        self._outcome: BaseException | None = None

    def start(self) -> None:
        try:
            self._waiting = self._coro.send(None)
        except BaseException as exc:  # StopIteration with its value, or what it raised: the task's end
            self._outcome = exc

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            if self._outcome is not None:
                raise self._outcome
            waiting = self._waiting
            if waiting is not None and not waiting.done():
                return waiting
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._first = False
        if self._outcome is not None:
            raise self._outcome
        return self._coro.throw(typ, val, tb) if val is not None or tb is not None else self._coro.throw(typ)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        raise TypeError("a started coroutine is driven by its task only")
