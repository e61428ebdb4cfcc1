"""WaitQueue: the order of admission by priority class, tenant turns and arrival; deadlines."""

from __future__ import annotations

import pytest

from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence
from serving.engine.wait_queue import MAX_SKIPS, WaitQueue

INTERACTIVE, BATCH = 0, 1


def seq(seq_id: int, *, priority: int = INTERACTIVE, tenant: str = "", deadline_s: float | None = None) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], 3, SamplingParams(), priority=priority, tenant=tenant, deadline_s=deadline_s)


def served(queue: WaitQueue) -> list[int]:
    """Admit everyone, one at a time: the ids in the order served."""
    order = []
    while queue:
        head = queue.head()
        popped = queue.pop_head()
        assert popped is head
        order.append(popped.seq_id)
    return order


def filled(*seqs: Sequence, max_skips: int = MAX_SKIPS) -> WaitQueue:
    queue = WaitQueue(max_skips)
    for item in seqs:
        queue.push(item)
    return queue


def test_fifo_within_one_tenant_and_class():
    assert served(filled(*(seq(i) for i in range(5)))) == [0, 1, 2, 3, 4]


def test_interactive_is_served_before_batch_that_arrived_earlier():
    queue = filled(seq(1, priority=BATCH), seq(2, priority=BATCH), seq(3), seq(4))
    assert served(queue) == [3, 4, 1, 2]


def test_batch_is_not_starved_it_gets_one_admission_in_every_max_skips_plus_one():
    queue = filled(*(seq(i) for i in range(12)), seq(100, priority=BATCH), seq(101, priority=BATCH),
                   max_skips=3)
    order = served(queue)
    assert order == [0, 1, 2, 100, 3, 4, 5, 101, 6, 7, 8, 9, 10, 11]
    # The bound, stated as the docstring does: while both wait, batch gets >= 1 of every max_skips + 1.
    assert order.index(100) <= 3 and order.index(101) - order.index(100) <= 4


def test_interactive_arriving_all_the_time_still_lets_batch_through():
    queue = WaitQueue()
    queue.push(seq(999, priority=BATCH))
    order = []
    for i in range(20):  # a steady stream: one interactive arrives per admission
        queue.push(seq(i))
        order.append(queue.pop_head().seq_id)
    assert 999 in order and order.index(999) == MAX_SKIPS


def test_a_tenant_with_twenty_queued_does_not_starve_another_tenants_single_request():
    queue = filled(*(seq(i, tenant="a") for i in range(20)), seq(100, tenant="b"))
    order = served(queue)
    assert order.index(100) == 1  # a's first request, then b's turn
    assert [i for i in order if i != 100] == list(range(20))  # a stays first in, first out


def test_tenants_take_turns_round_robin():
    queue = filled(seq(1, tenant="a"), seq(2, tenant="a"), seq(3, tenant="a"), seq(4, tenant="b"),
                   seq(5, tenant="b"), seq(6, tenant="c"))
    assert served(queue) == [1, 4, 6, 2, 5, 3]


def test_a_tenant_new_to_the_class_joins_at_the_end_of_the_round():
    queue = filled(seq(1, tenant="a"), seq(2, tenant="b"), seq(3, tenant="a"), seq(4, tenant="b"))
    assert queue.pop_head().seq_id == 1
    queue.push(seq(5, tenant="c"))
    assert served(queue) == [2, 3, 5, 4]


def test_preempted_sequences_go_back_to_the_front_in_admission_order():
    queue = filled(seq(1), seq(2, tenant="x"))
    first, second = seq(10, priority=BATCH), seq(11)
    first.first_scheduled_s = second.first_scheduled_s = 0.0  # admitted once, 10 before 11
    queue.push_front(second)  # victims come newest first
    queue.push_front(first)
    assert list(queue)[:2] == [first, second]
    assert served(queue) == [10, 11, 1, 2]


def test_iteration_is_the_order_of_service_and_leaves_the_queue_alone():
    queue = filled(*(seq(i, tenant="a") for i in range(6)), seq(50, tenant="b"), seq(60, priority=BATCH),
                   max_skips=2)
    listed = [s.seq_id for s in queue]
    assert len(queue) == 8
    assert listed == served(queue) == [0, 50, 60, 1, 2, 3, 4, 5]


def test_remove_takes_a_sequence_out_wherever_it_waits():
    resumed = seq(9)
    queue = filled(seq(1, tenant="a"), seq(2, tenant="b"), seq(3, priority=BATCH))
    queue.push_front(resumed)
    assert queue.remove(2).seq_id == 2 and queue.remove(9) is resumed
    assert queue.remove(2) is None and queue.remove(42) is None
    assert len(queue) == 2 and served(queue) == [1, 3]


def test_the_head_stays_the_head_until_popped():
    queue = filled(*(seq(i) for i in range(MAX_SKIPS)), seq(100, priority=BATCH))
    for _ in range(MAX_SKIPS):
        queue.pop_head()
    assert queue.head().seq_id == 100
    queue.push(seq(7))  # a newcomer does not take the starved class's turn
    assert queue.head().seq_id == 100
    assert served(queue) == [100, 7]


def test_expire_removes_unstarted_sequences_whose_deadline_passed():
    late, later, none = seq(1, deadline_s=10.0), seq(2, deadline_s=20.0), seq(3)
    started = seq(4, deadline_s=5.0)
    started.first_scheduled_s = 1.0  # preempted after starting: its deadline no longer applies
    queue = filled(late, later, none)
    queue.push_front(started)
    assert queue.expire(9.9) == []
    assert queue.expire(10.0) == [late]
    assert queue.expire(15.0) == []
    assert queue.expire(25.0) == [later]
    assert len(queue) == 2 and served(queue) == [4, 3]


def test_max_skips_must_be_positive():
    with pytest.raises(ValueError, match="max_skips"):
        WaitQueue(0)
