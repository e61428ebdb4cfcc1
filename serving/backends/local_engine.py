"""A local model's engine replicas as the pipeline's Engine protocol.

This is where the engine's own errors become the pipeline's (``pipeline.errors``), so that the engine
imports nothing of ours. With ``replicas: N`` a :class:`Placement` picks the replica of each request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import fields

from pipeline.errors import BackendError, DeadlineExceeded, InvalidInput, Overloaded
from pipeline.protocols import PRIORITY_CLASSES, ModelOccupancy, SamplingParams, SchedulingHints, TokenEvent
from serving.backends.placement import Placement, ReplicaOccupancy, ewma
from serving.backends.tokenizer import HFTokenizer
from serving.engine.async_engine import AsyncEngine, RequestStream
from serving.engine.errors import EngineDeadlineExceeded, EngineError, EngineOverloaded, InvalidRequest
from serving.engine.sampling_params import SamplingParams as EngineSampling

#: The pipeline's sampling fields: the engine's SamplingParams declares the same ones (the engine imports
#: nothing of ours; tests/serving/backends/test_sampling_params.py fails when the two drift apart).
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def engine_sampling(sampling: SamplingParams) -> EngineSampling:
    """The pipeline's sampling as the engine's: field by field, as ``dataclasses.asdict`` would deep-copy
    every value on the event loop."""
    return EngineSampling(**{name: getattr(sampling, name) for name in _SAMPLING_FIELDS})


class _Stream:
    """An engine stream whose errors are the pipeline's; reports its first token's time to its model.

    It counts as its replica's load (``LocalEngine.outstanding``) from submit until it ends, fails or is closed,
    or its reader (the async generator ``__aiter__`` returns) is closed or cancelled: the engine request is
    aborted then too. A stream nobody reads counts until its opener closes it (``aclose``; the ``generate``
    stage closes its stream when the request ends).
    """

    __slots__ = ("_open", "_owner", "_stream", "_submitted_s", "replica")

    def __init__(self, stream: RequestStream, owner: LocalEngine, replica: int, submitted_s: float):
        self._stream, self._owner = stream, owner
        #: Which of the model's replicas serves this request (0 with one replica).
        self.replica = replica
        self._submitted_s = submitted_s
        self._open = True

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        timed = False
        try:
            async for event in self._stream:
                if not timed and event.token_id is not None:
                    timed = True
                    self._owner.observe_ttft(time.perf_counter() - self._submitted_s)
                yield event
        except EngineDeadlineExceeded as exc:
            raise DeadlineExceeded(f"model {self._owner.name!r}: {exc}") from exc
        except EngineError as exc:
            raise BackendError(f"model {self._owner.name!r}: {exc}") from exc
        finally:
            # Ended, failed, or left at a yield (the reader closed or cancelled): a no-op on an ended stream.
            await self.aclose()

    async def aclose(self) -> None:
        """Stop early: the engine aborts the request; the replica's load count drops now. Idempotent."""
        if self._open:
            self._open = False
            self._owner.outstanding[self.replica] -= 1
        await self._stream.aclose()


class LocalEngine:
    """The pipeline's Engine protocol over a model's :class:`AsyncEngine` replicas."""

    def __init__(self, name: str, replicas: AsyncEngine | Sequence[AsyncEngine], weights_hash: str,
                 placement: Placement | None = None):
        self.name = name
        self.replicas = [replicas] if isinstance(replicas, AsyncEngine) else list(replicas)
        #: Replica 0 (the only one, usually): for callers that want an engine's stats.
        self.engine = self.replicas[0]
        self.tokenizer = HFTokenizer(self.engine.tokenizer)
        self.weights_hash = weights_hash
        self.placement = placement or Placement(len(self.replicas))
        #: Per replica, requests submitted whose stream has not ended: this counts the ones still on their way
        #: to the engine thread, which the scheduler's queues do not show yet (a burst would all look idle).
        self.outstanding = [0] * len(self.replicas)
        #: Exponential average of the time from submit to first token; None before the first.
        self.ttft_s: float | None = None

    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str = "", *,
                     hints: SchedulingHints | None = None) -> _Stream:
        submitted_s = time.perf_counter()
        hints = hints or SchedulingHints()
        index = 0
        if len(self.replicas) > 1:
            index = self.placement.choose(prompt_ids, cache_salt, self.replica_occupancy())
        try:
            stream = await self.replicas[index].submit(
                prompt_ids, engine_sampling(sampling), cache_salt,
                priority=PRIORITY_CLASSES.index(hints.priority), tenant=hints.tenant, deadline_s=hints.deadline_s)
        except EngineOverloaded as exc:
            raise Overloaded(f"model {self.name!r} is overloaded: {exc}", exc.retry_after_s) from exc
        except InvalidRequest as exc:
            raise InvalidInput(str(exc)) from exc
        except EngineError as exc:
            raise BackendError(f"model {self.name!r}: {exc}") from exc
        self.outstanding[index] += 1
        return _Stream(stream, self, index, submitted_s)

    def replica_occupancy(self) -> list[ReplicaOccupancy]:
        """Each replica's load now; no I/O, no lock (counts read while the engine thread runs may be a step old)."""
        loads = []
        for replica, outstanding in zip(self.replicas, self.outstanding, strict=True):
            scheduler = replica.engine.scheduler
            running = scheduler.num_running
            # Outstanding minus running: waiting in the scheduler plus not yet handed to it.
            loads.append(ReplicaOccupancy(max(scheduler.num_waiting, outstanding - running), running))
        return loads

    def occupancy(self) -> ModelOccupancy:
        """The model's load: waiting and running summed over replicas, and the recent time to first token."""
        loads = self.replica_occupancy()
        return ModelOccupancy(sum(load.waiting for load in loads), sum(load.running for load in loads), self.ttft_s)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s = ewma(self.ttft_s, seconds)

    def named_replicas(self) -> dict[str, AsyncEngine]:
        """Replicas by metrics name: the model's name for replica 0, ``name#i`` for replica i."""
        return {replica_name(self.name, i): replica for i, replica in enumerate(self.replicas)}

    async def aclose(self) -> None:
        """Shut every replica down (the model pool's close)."""
        for replica in self.replicas:
            await replica.shutdown()


def replica_name(model: str, index: int) -> str:
    """What replica *index* of *model* is called in metrics and readiness (replica 0: the model's name)."""
    return model if index == 0 else f"{model}#{index}"
