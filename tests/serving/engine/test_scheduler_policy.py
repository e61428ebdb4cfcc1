"""The scheduler's admission policy under contention: priority classes, tenant turns, deadlines.

Each test runs the real scheduler and block manager (no model) and reads the order of service off
the steps: a sequence is served when it is first scheduled.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.wait_queue import MAX_SKIPS
from tests.serving.engine.test_scheduler import make_scheduler, reference_output, run_to_completion, shares, step

INTERACTIVE, BATCH = 0, 1


def make_seq(seq_id: int, prompt: int = 4, *, priority: int = INTERACTIVE, tenant: str = "",
             deadline_s: float | None = None, max_tokens: int = 1) -> Sequence:
    token_ids = list(range(seq_id * 1000 + 1, seq_id * 1000 + 1 + prompt))
    return Sequence(seq_id, token_ids, prompt, SamplingParams(max_tokens=max_tokens), priority=priority,
                    tenant=tenant, deadline_s=deadline_s)


def order_of_service(scheduler: Scheduler, max_steps: int = 1000) -> list[int]:
    """Run everything to completion; the seq ids in the order they were first scheduled."""
    order: list[int] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return order
        output, _ = step(scheduler)
        order += [item.seq.seq_id for item in output.scheduled if item.seq.seq_id not in order]
    raise AssertionError(f"not finished after {max_steps} steps")


def contended(**overrides) -> Scheduler:
    """One request at a time: every admission is a choice among all who wait."""
    return make_scheduler(**{"max_num_seqs": 1, "max_waiting": 64, **overrides})


def test_interactive_is_served_before_batch_under_contention():
    scheduler = contended()
    for seq_id in (1, 2, 3):
        scheduler.add(make_seq(seq_id, priority=BATCH))
    for seq_id in (4, 5):
        scheduler.add(make_seq(seq_id))
    assert order_of_service(scheduler) == [4, 5, 1, 2, 3]


def test_batch_is_not_starved_by_a_flood_of_interactive_requests():
    scheduler = contended()
    scheduler.add(make_seq(100, priority=BATCH))
    for seq_id in range(1, 11):
        scheduler.add(make_seq(seq_id))
    order = order_of_service(scheduler)
    # Passed over MAX_SKIPS admissions at most: batch gets one in every MAX_SKIPS + 1.
    assert order.index(100) == MAX_SKIPS
    assert [i for i in order if i != 100] == list(range(1, 11))


def test_batch_keeps_its_share_while_interactive_keeps_arriving():
    scheduler = contended()
    for seq_id in (100, 101, 102):
        scheduler.add(make_seq(seq_id, priority=BATCH))
    order: list[int] = []
    for seq_id in range(1, 16):  # one new interactive request per step: the interactive queue never drains
        scheduler.add(make_seq(seq_id))
        output, _ = step(scheduler)
        order += [item.seq.seq_id for item in output.scheduled]
    positions = [order.index(i) for i in (100, 101, 102)]
    assert positions == [MAX_SKIPS, 2 * MAX_SKIPS + 1, 3 * MAX_SKIPS + 2]


def test_one_tenants_flood_does_not_starve_another_tenants_single_request():
    scheduler = contended()
    for seq_id in range(1, 21):
        scheduler.add(make_seq(seq_id, tenant="a"))
    scheduler.add(make_seq(100, tenant="b"))
    order = order_of_service(scheduler)
    assert order.index(100) == 1  # served second, not twenty-first
    assert [i for i in order if i != 100] == list(range(1, 21))  # first in, first out within a


def test_tenants_share_the_batch_class_too_and_fifo_holds_within_each():
    scheduler = contended()
    for seq_id, tenant in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b"), (6, "c")]:
        scheduler.add(make_seq(seq_id, priority=BATCH, tenant=tenant))
    assert order_of_service(scheduler) == [1, 4, 6, 2, 5, 3]


def test_a_preempted_sequence_goes_back_to_the_front_ahead_of_interactive():
    scheduler = make_scheduler(block_size=2, num_blocks=4, max_waiting=64)
    a = make_seq(1, 3, max_tokens=4)
    b = make_seq(2, 3, priority=BATCH, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # both prompts fill the pool
    waiting = make_seq(3, 3, max_tokens=1)
    scheduler.add(waiting)
    step(scheduler)
    output, _ = step(scheduler)  # a needs a third block: b, the newest, is preempted
    assert output.preempted == [b]
    assert list(scheduler.waiting) == [b, waiting]  # batch, but admitted once: first
    run_to_completion(scheduler)
    assert b.first_scheduled_s is not None and waiting.first_scheduled_s is not None
    for seq in (a, b, waiting):
        assert seq.output_token_ids == reference_output(seq)
    assert scheduler.block_manager.num_used_blocks == 0


def test_nobody_overtakes_a_head_that_does_not_fit():
    scheduler = make_scheduler(block_size=4, num_blocks=6, max_waiting=64)
    hog = make_seq(1, 8, max_tokens=3)  # 3 blocks until it finishes
    big = make_seq(2, 16, priority=BATCH)  # 4 blocks: fits only once the hog is gone
    scheduler.add(hog)
    for seq_id in range(10, 10 + MAX_SKIPS):
        scheduler.add(make_seq(seq_id, 1))
    scheduler.add(big)
    step(scheduler)  # the hog and fillers go in; then it is batch's turn, and big does not fit
    assert scheduler.waiting.head() is big
    small = make_seq(3, 2)  # one block: it would fit
    scheduler.add(small)
    output, _ = step(scheduler)
    assert shares(output) == {1: 1}
    assert scheduler.waiting.head() is big and small in list(scheduler.waiting)
    run_to_completion(scheduler)
    assert big.first_scheduled_s < small.first_scheduled_s


def test_a_waiting_sequence_past_its_deadline_is_dropped_before_prefill():
    scheduler = contended()
    hog = make_seq(1, max_tokens=50)
    scheduler.add(hog)
    step(scheduler)
    patient = make_seq(2, deadline_s=time.perf_counter() + 3600)
    late = make_seq(3, deadline_s=time.perf_counter() - 0.001)
    scheduler.add(patient)
    scheduler.add(late)
    output, finished = step(scheduler)
    assert output.finished == [late] and late in finished
    assert (late.status, late.finish_reason) == (SequenceStatus.FINISHED, "deadline")
    assert (late.first_scheduled_s, late.num_computed_tokens, late.block_table) == (None, 0, [])
    assert patient.status is SequenceStatus.WAITING  # its deadline is far: it waits for the hog's slot
    assert list(scheduler.waiting) == [patient] and shares(output) == {1: 1}


def test_a_deadline_drop_does_not_wait_for_the_sequence_to_reach_the_head():
    scheduler = contended()
    scheduler.add(make_seq(1, max_tokens=50))
    for seq_id in range(2, 6):
        scheduler.add(make_seq(seq_id))
    last = make_seq(9, priority=BATCH, deadline_s=time.perf_counter() - 1)
    scheduler.add(last)
    output, _ = step(scheduler)
    assert output.finished == [last] and last.finish_reason == "deadline"
    assert [s.seq_id for s in scheduler.waiting] == [2, 3, 4, 5]


def test_a_running_sequence_is_never_dropped_for_its_deadline():
    scheduler = contended()
    seq = make_seq(1, max_tokens=5, deadline_s=time.perf_counter() + 3600)
    scheduler.add(seq)
    step(scheduler)
    assert seq.status is SequenceStatus.RUNNING
    seq.deadline_s = time.perf_counter() - 1
    finished = run_to_completion(scheduler)
    assert finished == [seq] and seq.finish_reason == "length" and seq.num_output_tokens == 5


def test_a_preempted_sequence_is_not_dropped_for_its_deadline():
    scheduler = make_scheduler(block_size=2, num_blocks=4, max_waiting=64)
    a = make_seq(1, 3, max_tokens=4)
    b = make_seq(2, 3, max_tokens=4, deadline_s=time.perf_counter() + 3600)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    step(scheduler)
    b.deadline_s = time.perf_counter() - 1
    output, _ = step(scheduler)
    assert output.preempted == [b]
    expired = make_seq(3, 3, deadline_s=time.perf_counter() - 1)
    scheduler.add(expired)
    output, _ = step(scheduler)
    assert output.finished == [expired]  # the queue was swept: b, past its deadline too, stays
    assert b.status is SequenceStatus.WAITING and b.finish_reason is None
    finished = run_to_completion(scheduler)
    assert b in finished and b.finish_reason == "length"
    assert b.output_token_ids == reference_output(b)


def test_abort_takes_a_sequence_out_of_the_policy_queue():
    scheduler = contended()
    scheduler.add(make_seq(1, max_tokens=50))
    step(scheduler)
    a, b = make_seq(2, tenant="a"), make_seq(3, priority=BATCH, tenant="b")
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.abort(2) is a and a.finish_reason == "abort"
    assert list(scheduler.waiting) == [b] and scheduler.num_waiting == 1


# -- the engine's async front: a deadline drop reaches the caller as a typed error ----------------


class StubEngine:
    """What AsyncEngine drives of an LLMEngine: a real scheduler, and a "model" that always says 7."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.config = scheduler, scheduler.config
        self._ids = iter(range(1_000_000))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def make_sequence(self, prompt_ids, sampling, cache_salt="", *, priority=0, tenant="", deadline_s=None):
        return Sequence(next(self._ids), list(prompt_ids), len(prompt_ids), sampling, cache_salt=cache_salt,
                        priority=priority, tenant=tenant, deadline_s=deadline_s)

    def enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)

    def step(self):
        from serving.engine.engine import StepOutput

        time.sleep(0.001)  # a step takes time; the loop must not spin
        plan = self.scheduler.schedule()
        sampling = [item.seq for item in plan.scheduled if item.samples]
        self.scheduler.update(plan, {seq.seq_id: 7 for seq in sampling})
        return [StepOutput(seq.seq_id, seq.last_token_id if seq in sampling else None, seq.finish_reason, None,
                           seq.num_prompt_tokens, 0, seq.num_output_tokens) for seq in [*plan.finished, *sampling]]


@pytest.fixture
async def async_engine():
    from serving.engine.async_engine import AsyncEngine

    engine = AsyncEngine(engine=StubEngine(contended()))  # type: ignore[arg-type]
    await engine.start()
    yield engine
    await engine.shutdown()


async def test_the_async_engine_raises_a_typed_error_for_a_deadline_drop(async_engine):
    from serving.engine.errors import EngineDeadlineExceeded

    hog = await async_engine.submit([1, 2, 3], SamplingParams(max_tokens=100_000, ignore_eos=True))
    assert (await hog.__anext__()).token_id == 7  # it runs, and holds the only slot
    late = await async_engine.submit([4, 5], SamplingParams(max_tokens=1), priority=BATCH, tenant="t",
                                     deadline_s=time.perf_counter() + 0.02)
    with pytest.raises(EngineDeadlineExceeded, match="dropped before prefill"):
        async with asyncio.timeout(5):
            await late.__anext__()
    assert (await hog.__anext__()).finish_reason is None  # the running one goes on
    assert async_engine.engine.scheduler.num_waiting == 0
    await hog.aclose()


@pytest.mark.slow
def test_the_engine_ends_a_dropped_request_with_its_reason_and_counts_it(loaded_model):
    from serving.engine.config import EngineConfig
    from serving.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="models/smollm2-135m-instruct", max_num_seqs=1), loaded=loaded_model)
    running = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0),
                                 deadline_s=time.perf_counter() + 3600)
    engine.step()
    late = engine.add_request([4, 5, 6], SamplingParams(max_tokens=4, temperature=0), priority=BATCH, tenant="t",
                              deadline_s=time.perf_counter() - 1)
    outputs = engine.step()
    dropped = [out for out in outputs if out.seq_id == late.seq_id]
    assert len(dropped) == 1 and (dropped[0].token_id, dropped[0].finish_reason) == (None, "deadline")
    assert engine.stats()["num_deadline_drops"] == 1
    running.deadline_s = time.perf_counter() - 1  # running: its deadline no longer matters
    while engine.has_unfinished:
        engine.step()
    assert running.finish_reason in ("stop", "length") and running.num_output_tokens >= 1


# -- the engine's async front: the first step after an idle spell waits for the loop's queued arrivals --


class RecordingEngine(StubEngine):
    """The stub, noting each step's sequences; ``stepped`` is set once it has stepped."""

    def __init__(self, scheduler: Scheduler):
        super().__init__(scheduler)
        self.steps: list[list[int]] = []
        self.stepped = threading.Event()

    def step(self):
        outputs = super().step()
        self.steps.append(sorted(out.seq_id for out in outputs))
        self.stepped.set()
        return outputs


def busy(seconds: float) -> None:
    """Hold the CPU and the GIL, as an HTTP handler parsing a request does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_burst_queued_on_the_loop_joins_the_first_step():
    from serving.engine.async_engine import AsyncEngine

    stub = RecordingEngine(make_scheduler(max_num_seqs=8, max_waiting=64))
    engine = AsyncEngine(engine=stub)  # type: ignore[arg-type]
    await engine.start()

    async def handler(n: int) -> list[int]:
        busy(0.003)  # parsing: the first submission wakes the engine while the others still wait for the loop
        stream = await engine.submit([n + 1, n + 2], SamplingParams(max_tokens=2))
        return [event.token_id async for event in stream]

    try:
        answers = await asyncio.gather(*(handler(n) for n in range(4)))
    finally:
        await engine.shutdown()
    assert answers == [[7, 7]] * 4
    assert stub.steps[0] == [0, 1, 2, 3]  # one prefill for the burst, not the first alone


async def test_the_first_step_does_not_wait_for_a_loop_that_stays_busy(monkeypatch):
    from serving.engine import async_engine
    from serving.engine.async_engine import AsyncEngine

    monkeypatch.setattr(async_engine, "GATHER_MAX_S", 0.01)
    stub = RecordingEngine(make_scheduler(max_num_seqs=8, max_waiting=64))
    engine = AsyncEngine(engine=stub)  # type: ignore[arg-type]
    await engine.start()
    try:
        stream = await engine.submit([1, 2], SamplingParams(max_tokens=1))
        # The loop does not come back (a blocking wait, not an await) until the engine has stepped.
        assert stub.stepped.wait(timeout=10), "the engine waited for the loop"
        assert [event.token_id async for event in stream] == [7]
    finally:
        await engine.shutdown()
