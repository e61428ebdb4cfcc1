"""RayEngine over a fake deployment handle: errors, load accounting and cancellation, without Ray running."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.errors import BackendError, InvalidInput, Overloaded
from pipeline.protocols import SamplingParams
from serving.ray_backend import RayEngine  # Ray Serve: the ray extra, which make install installs


def token(i: int, finish: str | None = None) -> dict:
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


@pytest.mark.parametrize(("item", "error"), [
    ({"error": "overloaded", "message": "full", "retry_after_s": 2.0}, Overloaded),
    ({"error": "invalid", "message": "top_p must be in (0, 1]"}, InvalidInput),
    ({"error": "engine", "message": "boom"}, BackendError),
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
