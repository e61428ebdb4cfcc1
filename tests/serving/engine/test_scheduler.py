"""Scheduler: continuous batching, chunked prefill, preemption, finishing, aborts."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import pytest

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineOverloaded
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence, SequenceStatus

EOS = 0


def make_scheduler(**overrides) -> Scheduler:
    options = {"model": "fake", "block_size": 4, "num_blocks": 64, "max_num_seqs": 8,
               "max_num_batched_tokens": 32, "max_waiting": 16}
    config = EngineConfig(**{**options, **overrides})
    manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
    return Scheduler(config, manager, frozenset({EOS}))


def make_seq(seq_id: int, prompt: list[int] | int = 4, *, cache_salt: str = "",
             eos_token_ids: frozenset[int] = frozenset(), **sampling) -> Sequence:
    token_ids = list(range(seq_id * 1000 + 1, seq_id * 1000 + 1 + prompt)) if isinstance(prompt, int) else prompt
    return Sequence(seq_id, list(token_ids), len(token_ids), SamplingParams(**sampling),
                    eos_token_ids=eos_token_ids, cache_salt=cache_salt)


def next_token(token_ids: list[int]) -> int:
    """A deterministic stand-in for the model: never EOS."""
    return 1 + (sum(token_ids[-3:]) * 31 + len(token_ids)) % 49


def step(scheduler: Scheduler, sample: Callable[[list[int]], int] = next_token
         ) -> tuple[SchedulerOutput, list[Sequence]]:
    output = scheduler.schedule()
    sampled = {item.seq.seq_id: sample(item.seq.token_ids) for item in output.scheduled if item.samples}
    return output, scheduler.update(output, sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return finished
        finished += step(scheduler)[1]
    raise AssertionError(f"not finished after {max_steps} steps")


def reference_output(seq: Sequence, max_model_len: int | None = None,
                     sample: Callable[[list[int]], int] = next_token) -> list[int]:
    """What ``seq`` generates when run alone, one token at a time."""
    token_ids = seq.token_ids[:seq.num_prompt_tokens]
    while True:
        token_id = sample(token_ids)
        token_ids.append(token_id)
        if token_id == EOS or len(token_ids) - seq.num_prompt_tokens >= seq.sampling.max_tokens:
            break
        if max_model_len is not None and len(token_ids) >= max_model_len:
            break
    return token_ids[seq.num_prompt_tokens:]


def shares(output: SchedulerOutput) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new_tokens for item in output.scheduled}


def test_chunked_prefill_does_not_stall_running_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a, b = make_seq(1, 3, max_tokens=30), make_seq(2, 3, max_tokens=30)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    long = make_seq(3, 50, max_tokens=2)
    scheduler.add(long)
    chunks = []
    for num_steps in range(1, 5):
        output, _ = step(scheduler)
        assert output.num_batched_tokens <= 16
        assert shares(output)[1] == shares(output)[2] == 1
        assert a.num_output_tokens == b.num_output_tokens == 1 + num_steps
        chunks += [(item.num_new_tokens, item.samples) for item in output.scheduled if item.seq is long]
    assert chunks == [(14, False), (14, False), (14, False), (8, True)]
    assert long.num_output_tokens == 1


def test_budget_splits_prompts_first_in_first_out():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    for seq_id in (1, 2, 3):
        scheduler.add(make_seq(seq_id, 20, max_tokens=4))
    assert shares(step(scheduler)[0]) == {1: 16}
    assert shares(step(scheduler)[0]) == {1: 4, 2: 12}
    assert shares(step(scheduler)[0]) == {1: 1, 2: 8, 3: 7}
    assert shares(step(scheduler)[0]) == {1: 1, 2: 1, 3: 13}


def test_max_num_seqs_limits_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(seq_id, 4, max_tokens=1) for seq_id in (1, 2, 3)]
    for seq in seqs:
        scheduler.add(seq)
    output, finished = step(scheduler)
    assert shares(output) == {1: 4, 2: 4}
    assert finished == seqs[:2]
    assert shares(step(scheduler)[0]) == {3: 4}


def test_preemption_by_recompute_sends_the_newest_to_the_front():
    scheduler = make_scheduler(block_size=2, num_blocks=4)
    manager = scheduler.block_manager
    a, b, c = make_seq(1, 3, max_tokens=4), make_seq(2, 3, max_tokens=4), make_seq(3, 3, max_tokens=1)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # both prompts fill the pool
    scheduler.add(c)
    output, _ = step(scheduler)  # decodes still fit their second blocks; c does not fit
    assert shares(output) == {1: 1, 2: 1}
    output, _ = step(scheduler)  # a needs a third block: the newest running sequence goes
    assert output.preempted == [b]
    assert shares(output) == {1: 1}
    assert list(scheduler.waiting) == [b, c]
    assert (b.status, b.block_table, b.num_computed_tokens, b.num_preemptions) == (SequenceStatus.WAITING, [], 0, 1)
    assert manager.num_used_blocks == len(a.block_table) == 3
    first_scheduled_s = b.first_scheduled_s
    run_to_completion(scheduler)
    assert b.first_scheduled_s == first_scheduled_s
    for seq in (a, b, c):
        assert seq.output_token_ids == reference_output(seq)
    assert manager.num_used_blocks == 0


def test_a_sequence_that_needs_a_block_can_preempt_itself():
    scheduler = make_scheduler(block_size=2, num_blocks=4)
    a, b = make_seq(1, 3, max_tokens=4), make_seq(2, 4, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    output, _ = step(scheduler)  # a's token 3 fits its block; b's token 4 needs a fifth block
    assert shares(output) == {1: 1}
    assert output.preempted == [b]
    assert scheduler.running == [a]
    run_to_completion(scheduler)
    assert b.output_token_ids == reference_output(b)


def test_a_sequence_that_outgrows_the_whole_pool_finishes_with_length():
    scheduler = make_scheduler(block_size=2, num_blocks=2)
    seq = make_seq(1, 2, max_tokens=10)
    scheduler.add(seq)
    finished = run_to_completion(scheduler)
    assert finished == [seq]
    assert (seq.finish_reason, seq.num_tokens, seq.num_preemptions) == ("length", 5, 0)
    assert scheduler.block_manager.num_used_blocks == 0


def test_admission_is_first_in_first_out():
    scheduler = make_scheduler(block_size=4, num_blocks=4)
    running, big, small = make_seq(1, 8, max_tokens=5), make_seq(2, 12, max_tokens=2), make_seq(3, 2, max_tokens=1)
    for seq in (running, big, small):
        scheduler.add(seq)
    output, _ = step(scheduler)
    # big needs 3 blocks, 2 are free; small would fit but may not overtake it.
    assert shares(output) == {1: 8}
    assert list(scheduler.waiting) == [big, small]
    assert big.block_table == []
    step(scheduler)  # big is retried, still does not fit, and is not counted twice
    assert list(scheduler.waiting) == [big, small]
    assert scheduler.block_manager.num_prefix_query_tokens == 8 + 12
    run_to_completion(scheduler)
    assert big.first_scheduled_s < small.first_scheduled_s
    assert scheduler.block_manager.num_used_blocks == 0


def test_add_raises_overloaded_when_the_queue_is_full():
    scheduler = make_scheduler(max_waiting=2)
    scheduler.add(make_seq(1))
    scheduler.add(make_seq(2))
    with pytest.raises(EngineOverloaded) as caught:
        scheduler.add(make_seq(3))
    assert caught.value.retry_after_s == 1.0
    step(scheduler)
    scheduler.add(make_seq(3))
    assert scheduler.num_waiting == 1


def test_abort_frees_waiting_and_running_sequences():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_seq(1, 9), make_seq(2, 9)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.abort(1) is a
    assert scheduler.abort(2) is b
    for seq in (a, b):
        assert (seq.status, seq.finish_reason, seq.block_table) == (SequenceStatus.FINISHED, "abort", [])
    assert scheduler.abort(1) is None
    assert scheduler.abort(42) is None
    assert not scheduler.has_unfinished
    assert scheduler.block_manager.num_used_blocks == 0


def test_abort_between_schedule_and_update():
    scheduler = make_scheduler()
    seq = make_seq(1, 9)
    scheduler.add(seq)
    output = scheduler.schedule()
    scheduler.abort(1)
    assert scheduler.update(output, {}) == []
    assert seq.num_computed_tokens == 0
    assert scheduler.block_manager.num_used_blocks == 0


def test_update_uses_the_shares_fixed_at_schedule_time():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    seq = make_seq(1, 10, max_tokens=3)
    scheduler.add(seq)
    first, _ = step(scheduler)
    assert first.scheduled[0] == ScheduledSeq(seq, 6) and not first.scheduled[0].samples
    second = scheduler.schedule()
    item = second.scheduled[0]
    assert (item.num_new_tokens, item.samples) == (4, True)
    scheduler.update(second, {1: 7})
    assert (item.num_new_tokens, item.samples) == (4, True)
    assert (seq.num_computed_tokens, seq.output_token_ids) == (10, [7])


@pytest.mark.parametrize(("sampling", "seq_eos", "token_id", "reason", "num_output_tokens"), [
    ({"max_tokens": 5}, frozenset(), EOS, "stop", 1),
    ({"max_tokens": 3, "ignore_eos": True}, frozenset(), EOS, "length", 3),
    ({"max_tokens": 5, "ignore_eos": True, "stop_token_ids": (7,)}, frozenset(), 7, "stop", 1),
    ({"max_tokens": 5}, frozenset({9}), 9, "stop", 1),
    ({"max_tokens": 4}, frozenset(), 5, "length", 4),
])
def test_finish_reasons(sampling, seq_eos, token_id, reason, num_output_tokens):
    scheduler = make_scheduler()
    seq = make_seq(1, 4, eos_token_ids=seq_eos, **sampling)
    scheduler.add(seq)
    finished: list[Sequence] = []
    while not finished:
        finished = step(scheduler, lambda token_ids: token_id)[1]
    assert finished == [seq]
    assert seq.status is SequenceStatus.FINISHED
    assert (seq.finish_reason, seq.num_output_tokens) == (reason, num_output_tokens)
    assert scheduler.running == []
    assert scheduler.block_manager.num_used_blocks == 0


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=6)
    seq = make_seq(1, 4, max_tokens=10)
    scheduler.add(seq)
    run_to_completion(scheduler)
    assert (seq.finish_reason, seq.num_tokens) == ("length", 6)


class FakeModel:
    """Writes each computed token into its KV slot and checks every slot it attends to."""

    def __init__(self, manager: BlockManager, sample: Callable[[list[int]], int]):
        self.manager = manager
        self.sample = sample
        self.slots: dict[int, list[int | None]] = defaultdict(lambda: [None] * manager.block_size)

    def run(self, output: SchedulerOutput) -> dict[int, int]:
        size = self.manager.block_size
        sampled = {}
        for item in output.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            assert len(seq.block_table) * size >= end
            # Cached or computed earlier: the slots must hold exactly this prefix.
            assert [self.slots[seq.block_table[p // size]][p % size] for p in range(start)] == seq.token_ids[:start]
            for pos in range(start, end):
                block_id = seq.block_table[pos // size]
                assert self.manager.ref_count(block_id) == 1, "wrote into a shared block"
                self.slots[block_id][pos % size] = seq.token_ids[pos]
            if item.samples:
                sampled[seq.seq_id] = self.sample(seq.token_ids)
        return sampled


def check_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config, manager = scheduler.config, scheduler.block_manager
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert all(item.num_new_tokens >= 1 for item in output.scheduled)
    assert len({item.seq.seq_id for item in output.scheduled}) == len(output.scheduled)
    assert scheduler.num_running <= config.max_num_seqs
    assert all(seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0
               for seq in scheduler.waiting)
    assert all(seq.status is SequenceStatus.RUNNING for seq in scheduler.running)
    assert not set(output.preempted) & {item.seq for item in output.scheduled}
    holders: dict[int, list[tuple[Sequence, int]]] = defaultdict(list)
    for seq in scheduler.running:
        for index, block_id in enumerate(seq.block_table):
            holders[block_id].append((seq, index))
    assert [manager.ref_count(b) for b in range(manager.num_blocks)] == [
        len(holders.get(b, ())) for b in range(manager.num_blocks)]
    assert manager.num_used_blocks == len(holders)
    for shared in (h for h in holders.values() if len(h) > 1):
        # Shared only as the same cached prefix block: same position, same chained hash.
        hashes = {seq.block_hashes[i] if i < len(seq.block_hashes) else None for seq, i in shared}
        assert len(hashes) == 1 and None not in hashes


def eos_sometimes(token_ids: list[int]) -> int:
    return (sum(token_ids[-3:]) * 31 + len(token_ids)) % 50


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_invariants_and_returns_the_pool(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(block_size=4, num_blocks=16, max_num_seqs=6, max_num_batched_tokens=24,
                               max_waiting=10, max_model_len=64)
    manager = scheduler.block_manager
    model = FakeModel(manager, eos_sometimes)
    system_prompts = [[rng.randrange(1, 50) for _ in range(n)] for n in (0, 5, 8, 13, 20)]
    pending = []
    for seq_id in range(200):
        prompt = rng.choice(system_prompts) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 30))]
        seq = make_seq(seq_id, prompt, cache_salt=rng.choice(["", "tenant-b"]), max_tokens=rng.randint(1, 24))
        if manager.fits_pool(min(seq.num_tokens + seq.sampling.max_tokens, 64)):
            pending.append(seq)  # the engine rejects the others up front
    admitted, finished, aborted = list(pending), [], []
    for _ in range(20_000):
        if not pending and not scheduler.has_unfinished:
            break
        for _ in range(rng.randint(0, 3)):
            if pending and scheduler.num_waiting < scheduler.config.max_waiting:
                scheduler.add(pending.pop(0))
        live = [*scheduler.waiting, *scheduler.running]
        if live and rng.random() < 0.03:
            aborted.append(scheduler.abort(rng.choice(live).seq_id))
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        finished += scheduler.update(output, model.run(output))
        check_invariants(scheduler, SchedulerOutput())
    else:
        pytest.fail("the workload did not drain")
    assert manager.num_used_blocks == 0
    assert len(finished) + len(aborted) == len(admitted) > 150
    for seq in finished:
        assert seq.output_token_ids == reference_output(seq, 64, eos_sometimes)
    assert {seq.finish_reason for seq in finished} == {"stop", "length"}
    assert sum(seq.num_preemptions for seq in admitted) > 0
    assert manager.num_prefix_hit_tokens > 0
