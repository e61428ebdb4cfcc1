"""LocalEngine's streams: each counts as its replica's load until it ends or is closed, whoever stops reading it.

The replicas are stand-ins, but their streams are the engine's own RequestStream (fed by hand), so an abort is
what the engine thread would be asked to do. Every stream stays referenced to the end of its test: the counts
must come back by the stream's own bookkeeping, never because the stream was garbage-collected.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from pipeline.errors import BackendError
from pipeline.protocols import SamplingParams
from serving.backends.local_engine import LocalEngine
from serving.engine.async_engine import RequestStream, TokenEvent
from serving.engine.errors import EngineError


@dataclass
class Scheduler:
    num_waiting: int = 0
    num_running: int = 0


@dataclass
class Replica:
    """What LocalEngine reads of an AsyncEngine; ``submit`` gives an engine stream fed by the test."""

    scheduler: Scheduler = field(default_factory=Scheduler)
    tokenizer: object = None
    streams: list[RequestStream] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)

    @property
    def engine(self):
        return self

    async def submit(self, prompt_ids, sampling, cache_salt="", **hints):
        stream = RequestStream([len(self.streams)], self.aborted.append)
        self.streams.append(stream)
        return stream


def token(index: int, last: bool = False) -> TokenEvent:
    return TokenEvent(index, "length" if last else None, 4, 0, index + 1)


@pytest.fixture
def local() -> LocalEngine:
    return LocalEngine("smol", [Replica()], "hash")


async def test_a_reader_closed_mid_way_gives_its_load_back_and_aborts_the_request(local):
    stream = await local.submit([1, 2, 3, 4], SamplingParams(max_tokens=8))
    engine = local.replicas[0]
    engine.streams[0]._put(token(0))
    events = aiter(stream)
    assert (await anext(events)).token_id == 0
    assert local.outstanding == [1]
    await events.aclose()  # the reader stops iterating and closes its iterator, as `async for` + break + aclose
    assert local.outstanding == [0]
    assert engine.aborted == [0]  # the engine stops generating for nobody
    await stream.aclose()  # the opener's close after that changes nothing
    assert local.outstanding == [0] and engine.aborted == [0]


async def test_a_cancelled_reader_gives_its_load_back(local):
    stream = await local.submit([1, 2, 3, 4], SamplingParams(max_tokens=8))
    engine = local.replicas[0]
    engine.streams[0]._put(token(0))
    seen: list[int | None] = []

    async def read() -> None:
        async for event in stream:
            seen.append(event.token_id)

    reader = asyncio.create_task(read())
    while not seen:  # the reader has its first token and now waits for the next
        await asyncio.sleep(0)
    assert local.outstanding == [1]
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert local.outstanding == [0] and engine.aborted == [0]


async def test_a_stream_nobody_reads_counts_until_its_opener_closes_it(local):
    streams = [await local.submit([1], SamplingParams()) for _ in range(2)]
    assert local.outstanding == [2]
    await streams[0].aclose()
    await streams[0].aclose()  # idempotent: a second close takes nothing more off
    assert local.outstanding == [1] and local.replicas[0].aborted == [0]
    await streams[1].aclose()
    assert local.outstanding == [0]


async def test_a_stream_read_to_its_end_or_its_error_gives_its_load_back_without_an_abort(local):
    engine = local.replicas[0]
    ended = await local.submit([1], SamplingParams(max_tokens=2))
    engine.streams[0]._put(token(0))
    engine.streams[0]._put(token(1, last=True))
    assert [event.token_id async for event in ended] == [0, 1]
    failed = await local.submit([1], SamplingParams(max_tokens=2))
    engine.streams[1]._put(EngineError("the engine stopped"))
    with pytest.raises(BackendError, match="model 'smol': the engine stopped"):
        [event async for event in failed]
    assert local.outstanding == [0] and engine.aborted == []
    await ended.aclose()
    assert local.outstanding == [0] and engine.aborted == []
