"""RayEngine over a fake deployment handle (errors, load accounting, cancellation, events in lists), and the
replica side's batching of ready events, without Ray running."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.errors import BackendError, InvalidInput, Overloaded
from pipeline.protocols import SamplingParams
from serving.backends.ray_engine import RayEngine  # Ray Serve: the ray extra, which make install installs


def token(i: int, finish: str | None = None) -> list[dict]:
    """One streamed item: a list of one event, as EngineDeployment.generate yields it."""
    return [event(i, finish)]


def event(i: int, finish: str | None = None) -> dict:
    return {"token_id": i, "finish_reason": finish, "num_prompt_tokens": 3, "num_cached_tokens": 0,
            "num_output_tokens": i + 1}


class FakeResponse:
    def __init__(self, items, gate: asyncio.Event | None = None):
        self.items, self.gate, self.cancelled = list(items), gate, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.gate is not None:
            await self.gate.wait()
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, response: FakeResponse):
        self.response, self.calls = response, []

    def options(self, stream: bool):
        assert stream
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args):
        self.calls.append(args)
        return self.response


def engine(response: FakeResponse) -> RayEngine:
    return RayEngine("smol", FakeHandle(response), tokenizer=None, weights_hash="h")


async def test_tokens_stream_and_the_load_returns_to_zero():
    ray_engine = engine(FakeResponse([token(0), token(1), token(2, "stop")]))
    stream = await ray_engine.submit([1, 2, 3], SamplingParams(max_tokens=3))
    assert ray_engine.outstanding == 1
    assert [e.token_id async for e in stream] == [0, 1, 2]
    assert ray_engine.outstanding == 0 and ray_engine.ttft_s is not None


async def test_a_step_of_events_in_one_item_streams_event_by_event_and_names_its_replica():
    first = [{**event(0), "replica": "r1"}, event(1)]
    ray_engine = engine(FakeResponse([first, [event(2), event(3)], [event(4, "length")]]))
    stream = await ray_engine.submit([1, 2, 3], SamplingParams(max_tokens=5))
    assert stream.replica == "r1"
    assert [e.token_id async for e in stream] == [0, 1, 2, 3, 4]
    assert ray_engine.outstanding == 0


async def test_an_error_after_events_in_one_item_comes_after_them():
    ray_engine = engine(FakeResponse([token(0), [event(1), {"error": "backend", "message": "step failed"}]]))
    stream = await ray_engine.submit([1], SamplingParams())
    seen = []
    with pytest.raises(BackendError, match="step failed"):
        async for e in stream:
            seen.append(e.token_id)
    assert seen == [0, 1] and ray_engine.outstanding == 0


async def test_a_replica_streaming_single_dicts_still_reads():
    ray_engine = engine(FakeResponse([event(0), event(1, "stop")]))
    stream = await ray_engine.submit([1], SamplingParams())
    assert [e.token_id async for e in stream] == [0, 1] and stream.replica == ""


@pytest.mark.parametrize(("item", "error"), [
    ([{"error": "overloaded", "message": "full", "retry_after_s": 2.0}], Overloaded),
    ([{"error": "invalid", "message": "top_p must be in (0, 1]"}], InvalidInput),
    ([{"error": "engine", "message": "boom"}], BackendError),
])
async def test_errors_before_the_first_token_raise_from_submit(item, error):
    ray_engine = engine(FakeResponse([item]))
    with pytest.raises(error):
        await ray_engine.submit([1], SamplingParams())
    assert ray_engine.outstanding == 0


async def test_a_replica_failing_mid_stream_is_a_backend_error():
    ray_engine = engine(FakeResponse([token(0), RuntimeError("actor died")]))
    stream = await ray_engine.submit([1], SamplingParams())
    with pytest.raises(BackendError, match="replica failed"):
        _ = [e async for e in stream]
    assert ray_engine.outstanding == 0


async def test_a_caller_giving_up_before_the_first_token_cancels_the_ray_request():
    gate = asyncio.Event()
    response = FakeResponse([token(0, "stop")], gate)
    ray_engine = engine(response)
    task = asyncio.create_task(ray_engine.submit([1], SamplingParams()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert response.cancelled and ray_engine.outstanding == 0


async def test_closing_early_cancels_and_frees_the_slot():
    response = FakeResponse([token(0), token(1), token(2, "stop")])
    ray_engine = engine(response)
    stream = await ray_engine.submit([1], SamplingParams())
    await stream.aclose()
    assert response.cancelled and ray_engine.outstanding == 0


class FakeEngineStream:
    """An engine's RequestStream: events put from outside, like the engine thread's _dispatch."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def put(self, *items):
        for item in items:
            self.queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            item = await self.queue.get()
        except BaseException:
            self.closed = True  # as RequestStream does: a cancelled read aborts the request
            raise
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


def engine_event(i: int, finish: str | None = None):
    from serving.engine.async_engine import TokenEvent

    return TokenEvent(i, finish, 3, 0, i + 1)


async def test_events_ready_together_go_in_one_list():
    from serving.backends.ray_replica import ready_batches

    stream = FakeEngineStream()
    stream.put(engine_event(0), engine_event(1), engine_event(2))  # one step's worth, or a reader that lags
    batches = ready_batches(stream)
    assert [e.token_id for e in await anext(batches)] == [0, 1, 2]
    stream.put(engine_event(3), engine_event(4, "stop"), None)
    assert [[e.token_id for e in batch] async for batch in batches] == [[3, 4]]


async def test_batches_of_ready_events_are_taken_whole():
    from serving.backends.ray_replica import ready_batches

    stream = FakeEngineStream()
    batches = ready_batches(stream)
    waiting = asyncio.ensure_future(anext(batches))
    await asyncio.sleep(0.01)
    stream.put(engine_event(0))
    assert [e.token_id for e in await waiting] == [0]
    stream.put(engine_event(1), engine_event(2), engine_event(3, "stop"), None)
    await asyncio.sleep(0.01)
    assert [[e.token_id for e in batch] async for batch in batches] == [[1, 2, 3]]


async def test_an_engine_error_is_raised_after_the_events_before_it():
    from serving.backends.ray_replica import ready_batches
    from serving.engine.errors import EngineError

    stream = FakeEngineStream()
    stream.put(engine_event(0), engine_event(1), EngineError("the step failed"))
    seen = []
    with pytest.raises(EngineError, match="the step failed"):
        async for batch in ready_batches(stream):
            seen += [e.token_id for e in batch]
    assert seen == [0, 1]


async def test_closing_the_batches_aborts_the_engine_request():
    from serving.backends.ray_replica import ready_batches

    stream = FakeEngineStream()
    stream.put(engine_event(0))
    batches = ready_batches(stream)
    await anext(batches)
    await batches.aclose()
    await asyncio.sleep(0)
    assert stream.closed
