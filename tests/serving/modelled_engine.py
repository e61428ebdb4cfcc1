"""An engine whose scheduling is the real one and whose model is a step-time formula (no torch).

The real :class:`~serving.engine.scheduler.Scheduler` and block manager decide each step; a step
"runs" for ``step_ms(prefill_tokens, num_decodes)`` and every sampling sequence gets token 65 ('A').
Stepped synchronously on a virtual clock it is what ``profile_engine`` measures; behind ``submit`` it
steps in the event loop with ``asyncio.sleep``, a server-side stand-in whose speed is known exactly, so
that ``plan`` can be checked against ``load`` without the real model's speed (or noise) in the way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence
from tests.fakes import ByteTokenizer, FakeTokenEvent

TOKEN = 65
EOS = 0


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ModelledEngine:
    """``add_request``/``step`` like LLMEngine, ``submit`` like the async engine."""

    def __init__(self, step_ms: Callable[[int, int], float], config: EngineConfig | None = None,
                 clock: VirtualClock | None = None):
        self.config = config or EngineConfig(model="modelled", num_blocks=4096)
        self.step_ms = step_ms
        self.clock = clock
        self.tokenizer = ByteTokenizer()
        self.weights_hash = "0" * 64
        self.block_manager = BlockManager(self.config.num_blocks or 4096, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager, frozenset({EOS}))
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue[FakeTokenEvent]] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None

    # -- synchronous, as LLMEngine ---------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(self, prompt_ids, sampling, cache_salt: str = "") -> Sequence:
        seq = Sequence(next(self._ids), list(prompt_ids), len(prompt_ids), sampling, frozenset({EOS}), cache_salt)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[tuple[Sequence, str | None]]:
        plan, cost_ms = self._plan()
        if self.clock is not None:
            self.clock.now += cost_ms / 1e3
        return self._apply(plan)

    def _plan(self):
        plan = self.scheduler.schedule()
        decodes = sum(1 for item in plan.scheduled if item.num_new_tokens == 1 and item.seq.num_uncomputed_tokens == 1)
        prefill = sum(item.num_new_tokens for item in plan.scheduled) - decodes
        return plan, self.step_ms(prefill, decodes) if plan.scheduled else 0.0

    def _apply(self, plan) -> list[tuple[Sequence, str | None]]:
        sampled = [item.seq for item in plan.scheduled if item.samples]
        self.scheduler.update(plan, {seq.seq_id: TOKEN for seq in sampled})
        return [(seq, seq.finish_reason) for seq in sampled]

    # -- asynchronous, as the server's engine -----------------------------------

    async def submit(self, prompt_ids, sampling, cache_salt: str = "", *, hints=None):
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._loop())
        seq = self.add_request(prompt_ids, sampling, cache_salt)
        queue: asyncio.Queue[FakeTokenEvent] = asyncio.Queue()
        self._queues[seq.seq_id] = queue
        self._wake.set()  # type: ignore[union-attr]
        return _Stream(self, seq, queue)

    async def _loop(self) -> None:
        # Steps keep to their own timeline, as the real engine's thread does: a step that follows another
        # began when that one ended, however late the event loop (busy with HTTP work) woke after it. A
        # plain sleep per step would add the loop's lateness to every step, more at higher rates, and the
        # engine would run slower than its formula says.
        loop = asyncio.get_running_loop()
        end: float | None = None
        while True:
            if not self.scheduler.has_unfinished:
                self._wake.clear()  # type: ignore[union-attr]
                await self._wake.wait()  # type: ignore[union-attr]
                end = None
            plan, cost_ms = self._plan()
            end = (loop.time() if end is None else end) + cost_ms / 1e3
            await asyncio.sleep(max(0.0, end - loop.time()))
            for seq, reason in self._apply(plan):
                queue = self._queues.get(seq.seq_id)
                if queue is not None:
                    queue.put_nowait(FakeTokenEvent(TOKEN, reason, seq.num_prompt_tokens, seq.num_output_tokens))

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)
        self._queues.pop(seq_id, None)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()


class _Stream:
    def __init__(self, engine: ModelledEngine, seq: Sequence, queue: asyncio.Queue[FakeTokenEvent]):
        self.engine, self.seq, self.queue = engine, seq, queue

    def __aiter__(self):
        return self._events()

    async def _events(self):
        while True:
            event = await self.queue.get()
            yield event
            if event.finish_reason is not None:
                return

    async def aclose(self) -> None:
        if not self.seq.is_finished:
            self.engine.abort(self.seq.seq_id)
        self.engine._queues.pop(self.seq.seq_id, None)
