"""start_eagerly: a coroutine runs to its first wait at once, then on as a task, as create_task's would."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from pipeline.eager import start_eagerly, swap_current_task

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="caller")


async def test_it_runs_before_what_the_loop_already_has_ready_then_resumes_as_a_task():
    order: list[str] = []
    gate = asyncio.get_running_loop().create_future()

    async def work() -> int:
        order.append("started")
        value = await gate
        order.append("resumed")
        return value + 1

    asyncio.get_running_loop().call_soon(order.append, "ready before")
    task = start_eagerly(work())
    assert order == ["started"]  # create_task would have run nothing yet
    await asyncio.sleep(0)
    gate.set_result(41)
    assert await task == 42
    assert order == ["started", "ready before", "resumed"]


async def test_context_changes_stay_in_the_task_and_their_tokens_reset_after_a_wait():
    seen: list[str] = []

    async def work() -> None:
        token = VAR.set("task")
        await asyncio.sleep(0)  # a bare yield
        seen.append(VAR.get())
        await asyncio.sleep(0.001)
        VAR.reset(token)  # raises ValueError if resumed in another context
        seen.append(VAR.get())

    task = start_eagerly(work())
    assert VAR.get() == "caller"
    await task
    assert seen == ["task", "caller"] and VAR.get() == "caller"


async def test_a_cancellation_arrives_where_it_waits_and_cleanup_runs():
    events: list[str] = []
    forever = asyncio.get_running_loop().create_future()

    async def work() -> None:
        try:
            await forever
        except asyncio.CancelledError:
            events.append("cleanup")
            await asyncio.sleep(0)  # cleanup may wait too
            events.append("cleaned")
            raise

    task = start_eagerly(work())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and events == ["cleanup", "cleaned"] and forever.cancelled()


async def test_a_failed_wait_raises_inside_the_coroutine():
    gate = asyncio.get_running_loop().create_future()

    async def work() -> str:
        try:
            await gate
        except KeyError as exc:
            return f"caught {exc}"
        return "not reached"

    task = start_eagerly(work())
    gate.set_exception(KeyError("k"))
    assert await task == "caught 'k'"


async def test_a_coroutine_that_ends_before_waiting_ends_its_task_with_its_result_or_error():
    ran: list[str] = []

    async def value() -> int:
        ran.append("value")
        return 7

    async def broken() -> None:
        raise RuntimeError("bug")

    done, failed = start_eagerly(value()), start_eagerly(broken())
    assert ran == ["value"]
    assert await done == 7
    with pytest.raises(RuntimeError, match="bug"):
        await failed


async def test_a_cancellation_before_the_task_first_steps_still_reaches_the_coroutine():
    events: list[str] = []

    async def work() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            events.append("finally")

    task = start_eagerly(work())
    task.cancel()  # the loop has not run the task yet
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["finally"]


async def test_it_is_the_current_task_while_it_starts_so_a_timeout_cancels_it_not_the_caller():
    caller = asyncio.current_task()
    seen: list[object] = []

    async def work() -> str:
        seen.append(asyncio.current_task())
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        except TimeoutError:
            return "timed out"
        return "slept"

    task = start_eagerly(work())
    assert seen == [task] and asyncio.current_task() is caller
    assert await task == "timed out"


async def test_swap_current_task_hands_current_task_over_and_back():
    loop = asyncio.get_running_loop()
    caller = asyncio.current_task()
    other = loop.create_task(asyncio.sleep(0))  # not started: the loop has not stepped it yet
    swap_current_task(loop, caller, other)
    assert asyncio.current_task() is other
    with pytest.raises(RuntimeError):  # asyncio checks who leaves: a mix-up fails loudly
        swap_current_task(loop, caller, other)
    swap_current_task(loop, other, caller)
    assert asyncio.current_task() is caller
    await other


async def test_swap_current_task_outside_any_task_as_from_a_callback():
    loop = asyncio.get_running_loop()
    other = loop.create_task(asyncio.sleep(0))
    seen: list[object] = []

    def callback() -> None:  # callbacks run with no current task
        seen.append(asyncio.current_task())
        swap_current_task(loop, None, other)
        seen.append(asyncio.current_task())
        swap_current_task(loop, other, None)
        seen.append(asyncio.current_task())

    done = loop.create_future()
    loop.call_soon(lambda: (callback(), done.set_result(None)))
    await done
    assert seen == [None, other, None]
    await other
