"""The engine's async front: a background thread runs the step loop.

The model runs in its own thread because a step holds the CPU for tens of
milliseconds (torch releases the GIL inside its kernels, so the event loop
stays responsive). Requests and aborts cross into the thread through a
command queue; tokens cross back once per step with ``call_soon_threadsafe``.

    engine = AsyncEngine(EngineConfig(model="models/smollm2-135m-instruct"))
    await engine.start()
    stream = await engine.submit(prompt_ids, SamplingParams(max_tokens=32))
    async for event in stream:   # TokenEvent, the last one has finish_reason
        ...
    await engine.shutdown()

Cancelling the iteration (``aclose()``, or cancelling the task that iterates)
aborts the request; its KV blocks are freed at the start of the next step.

A request for ``n`` sequences (``SamplingParams.n``) has one stream: each event's ``index`` says
whose token it is, each sequence's last event carries its finish reason, and the stream ends after
the last of them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial
from typing import Any

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine, StepOutput
from serving.engine.errors import EngineDeadlineExceeded, EngineError, EngineOverloaded, EngineStopped
from serving.engine.heap import freeze_startup_heap, thaw
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence

logger = logging.getLogger(__name__)

#: The interpreter's GIL switch interval while an engine runs (the default is 5 ms). A step is a few
#: hundred torch calls, each of which gives the GIL up and takes it back; when it is back the event
#: loop may hold it, streaming tokens, and the engine thread then waits for the loop to give it up,
#: or for up to a whole switch interval, at each of those calls: a shorter interval bounds that wait
#: (docs/engine.md, "The GIL switch interval").
GIL_SWITCH_INTERVAL_S = 0.0005

#: Before its first step after an idle spell, how long at most the engine waits for the event loop to run
#: what it already had ready (:meth:`AsyncEngine._gather`). In a burst of HTTP requests, the first to be
#: parsed wakes the engine while the others are still queued on the loop: without the wait, the first
#: prefilled alone, in a step of tens of milliseconds whose threads took the CPUs from the loop parsing
#: the rest. A lone request waits for one trip through the loop (tens of microseconds).
GATHER_MAX_S = 0.03


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token; the last event of a request carries its finish reason."""

    token_id: int | None
    """None only on a last event that ends the request without a new token."""
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    index: int = 0
    """Which of the request's ``n`` sequences this token is of."""


class RequestStream:
    """Async iterator over one request's :class:`TokenEvent`s (of all its sequences)."""

    def __init__(self, seq_ids: Seq[int], abort: Callable[[int], None]):
        self.seq_ids = tuple(seq_ids)
        self._queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._abort = abort
        self._num_running = len(self.seq_ids)
        self._done = False

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._num_running -= 1
            self._done = self._num_running == 0
        return item

    async def aclose(self) -> None:
        """Stop early: the engine aborts the request (every sequence still running) and frees its blocks."""
        if not self._done:
            self._done = True
            for seq_id in self.seq_ids:
                self._abort(seq_id)

    def _put(self, item: TokenEvent | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    """Runs an :class:`LLMEngine` in a background thread for asyncio callers."""

    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 **engine_options: Any):
        """Wrap *engine*, or build one from *config* (and *engine_options*, see LLMEngine) at start."""
        if engine is None and config is None:
            raise ValueError("give an EngineConfig or an LLMEngine")
        self._engine = engine
        self._config = config
        self._engine_options = engine_options
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, RequestStream] = {}
        self._num_pending = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._frozen = False  # holds a freeze_startup_heap() (serving/engine/heap.py)
        self.error: BaseException | None = None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineStopped("the engine is not started")
        return self._engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def start(self) -> None:
        """Load the model (in a worker thread) and start the step loop."""
        self._loop = asyncio.get_running_loop()
        if self._engine is None:
            self._engine = await asyncio.to_thread(partial(LLMEngine, self._config, **self._engine_options))
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # The loaded model and everything before it live as long as the engine: out of the collector's
        # sight, an oldest-generation collection does not walk them, so it does not stop the loop and the step.
        freeze_startup_heap()
        self._frozen = True
        self._thread = threading.Thread(target=self._run, name="inferline-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop; unfinished requests end with :class:`EngineStopped`."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for stream in self._streams.values():
            stream._put(EngineStopped("the engine shut down"))
        self._streams.clear()
        if self._frozen:
            self._frozen = False
            thaw()

    async def submit(self, prompt_ids: Seq[int], sampling: SamplingParams, cache_salt: str = "", *,
                     priority: int = 0, tenant: str = "", deadline_s: float | None = None) -> RequestStream:
        """Validate and queue a request. Raises InvalidRequest or EngineOverloaded at once.

        *priority*, *tenant* and *deadline_s* order it among the waiting (see ``LLMEngine.add_request``);
        still waiting at *deadline_s*, its stream raises :class:`EngineDeadlineExceeded`.
        """
        if self._thread is None or self._stopping:
            raise EngineStopped("the engine is not running")
        engine = self.engine
        seq = engine.make_sequence(prompt_ids, sampling, cache_salt, priority=priority, tenant=tenant,
                                   deadline_s=deadline_s)
        if engine.scheduler.num_waiting + self._num_pending >= engine.config.max_waiting:
            raise EngineOverloaded(f"{engine.config.max_waiting} requests are already waiting; retry shortly")
        stream = RequestStream([seq.seq_id, *(fork.seq_id for fork in seq.forks)], self._abort)
        for seq_id in stream.seq_ids:
            self._streams[seq_id] = stream
        self._num_pending += 1
        self._send("add", seq)
        return stream

    def stats(self) -> dict[str, object]:
        return self.engine.stats()

    # -- the engine thread ---------------------------------------------------

    def _abort(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)
        self._send("abort", seq_id)

    def _send(self, command: str, payload: object) -> None:
        self._commands.put((command, payload))
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        idle = True
        while not self._stopping:
            self._drain(engine)
            if not engine.has_unfinished:
                idle = True
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            if idle:
                idle = False
                self._gather(engine)
            try:
                outputs = engine.step()
            except Exception as exc:  # the loop must survive a failed step
                logger.exception("engine step failed")
                self._fail_running(engine, exc)
                continue
            if outputs:
                self._deliver(outputs)

    def _gather(self, engine: LLMEngine) -> None:
        """Wait until the event loop has run what was ready on it when the first request of a busy
        spell arrived (more requests of the same burst, being parsed), so that the first step takes
        them all; for at most :data:`GATHER_MAX_S`. Each round posts a marker behind the loop's ready
        callbacks; another round follows while the last one brought new requests."""
        loop = self._loop
        deadline = time.monotonic() + GATHER_MAX_S
        while loop is not None and not self._stopping:
            caught_up = threading.Event()
            try:
                loop.call_soon_threadsafe(caught_up.set)
            except RuntimeError:  # the loop is closed
                return
            if not caught_up.wait(max(0.0, deadline - time.monotonic())) or not self._drain(engine):
                return

    def _drain(self, engine: LLMEngine) -> bool:
        """Take the queued commands; whether there were any."""
        took = False
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return took
            took = True
            if command == "add":
                self._add(engine, payload)  # type: ignore[arg-type]
            else:
                engine.abort(payload)  # type: ignore[arg-type]

    def _add(self, engine: LLMEngine, seq: Sequence) -> None:
        try:
            engine.enqueue(seq)
        except EngineError as exc:
            self._call(self._fail, seq.seq_id, exc)
        finally:
            self._num_pending -= 1

    def _fail_running(self, engine: LLMEngine, exc: Exception) -> None:
        error = EngineError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        for seq in list(engine.scheduler.running):
            engine.abort(seq.seq_id)
            self._call(self._fail, seq.seq_id, error)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        self._call(self._dispatch, outputs)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- back on the event loop ----------------------------------------------

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.seq_id)
            if stream is None:
                continue  # aborted by its consumer
            if out.finish_reason == "deadline":
                self._drop(stream)
                stream._put(EngineDeadlineExceeded(
                    "the request was still waiting for the model at its deadline and was dropped before "
                    "prefill (the model is busy: retry later, or allow a longer queue timeout)"))
                continue
            lp = out.logprobs
            stream._put(TokenEvent(out.token_id, out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                                   out.num_output_tokens, lp.logprob if lp else None,
                                   tuple(lp.top_logprobs) if lp else (), out.index))
            if out.finish_reason is not None:
                del self._streams[out.seq_id]

    def _fail(self, seq_id: int, exc: BaseException) -> None:
        stream = self._streams.get(seq_id)
        if stream is not None:
            self._drop(stream)
            stream._put(exc)
            for other in stream.seq_ids:  # its other sequences (forks still queued) have nobody to read them
                if other != seq_id:
                    self._send("abort", other)

    def _drop(self, stream: RequestStream) -> None:
        """Forget every sequence of *stream*: it ends with an error, later outputs have nowhere to go."""
        for seq_id in stream.seq_ids:
            self._streams.pop(seq_id, None)
