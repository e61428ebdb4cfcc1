"""The waiting queue: who is admitted next, by priority class, tenant and arrival.

Plain Python (no torch). The scheduler admits from :meth:`WaitQueue.head`; the head is, in order:

1. A preempted sequence: it was admitted once (its prefix is likely still cached), so it comes back
   first, in its original admission order.
2. Otherwise the most urgent priority class with work (``Sequence.priority``: 0 interactive, 1 batch;
   lower first), except that a class passed over ``max_skips`` admissions in a row while it waited goes
   next. With interactive and batch both waiting, batch therefore gets at least one admission in every
   ``max_skips + 1``: it is slowed down, never starved.
3. Within a class, tenants take turns: one admission each, round robin, a tenant new to the class
   joining at the end of the round. A tenant with a hundred queued requests delays another tenant's
   single request by at most one admission per other tenant in the class.
4. Within a tenant, first in first out.

Fairness counts admissions, not tokens: a turn is one request, whatever its length.

Deadlines: :meth:`WaitQueue.expire` removes and returns the sequences that never started (no prefill
yet) whose ``deadline_s`` has passed; a preempted sequence already started and is never expired.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from serving.engine.sequence import Sequence

#: A waiting class is passed over at most this many admissions in a row (batch gets >= 1 in 5).
MAX_SKIPS = 4


@dataclass(slots=True)
class _Class:
    """One priority class: a FIFO queue per tenant, tenants served in turns."""

    queues: dict[str, deque[Sequence]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)
    """Tenants with waiting work, the next to be served first."""
    num_skips: int = 0
    """Admissions from more urgent classes in a row while this class waited."""

    def push(self, seq: Sequence) -> None:
        queue = self.queues.get(seq.tenant)
        if queue is None:
            queue = self.queues[seq.tenant] = deque()
            self.turns.append(seq.tenant)
        queue.append(seq)

    def head(self) -> Sequence:
        return self.queues[self.turns[0]][0]

    def pop_head(self) -> Sequence:
        tenant = self.turns.popleft()
        queue = self.queues[tenant]
        seq = queue.popleft()
        if queue:
            self.turns.append(tenant)  # its turn is used: to the end of the round
        else:
            del self.queues[tenant]
        return seq

    def remove(self, seq: Sequence) -> bool:
        queue = self.queues.get(seq.tenant)
        if queue is None or seq not in queue:
            return False
        queue.remove(seq)
        if not queue:
            del self.queues[seq.tenant]
            self.turns.remove(seq.tenant)
        return True

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self.queues.values():
            yield from queue

    def copy(self) -> _Class:
        return _Class({tenant: deque(queue) for tenant, queue in self.queues.items()}, deque(self.turns),
                      self.num_skips)


class WaitQueue:
    """Sequences waiting for admission, served by priority class, tenant turns and arrival.

    Iterating yields every waiting sequence in the order they would be admitted if nothing else
    arrived and each fitted.
    """

    def __init__(self, max_skips: int = MAX_SKIPS):
        if max_skips < 1:
            raise ValueError(f"max_skips must be at least 1, got {max_skips}")
        self.max_skips = max_skips
        self._resumed: deque[Sequence] = deque()
        """Preempted sequences, served before any class."""
        self._classes: dict[int, _Class] = {}
        """By priority; a class is here only while it has waiting sequences."""
        self._num_seqs = 0
        self._next_deadline_s = math.inf
        """No unstarted sequence's deadline is earlier (it may be later: a lower bound)."""

    def __len__(self) -> int:
        return self._num_seqs

    def __iter__(self) -> Iterator[Sequence]:
        yield from self._resumed
        classes = {priority: cls.copy() for priority, cls in self._classes.items()}
        while classes:
            yield self._take(classes, self._choose(classes))

    def push(self, seq: Sequence) -> None:
        """Queue a new sequence behind its tenant's earlier ones."""
        self._classes.setdefault(seq.priority, _Class()).push(seq)
        self._num_seqs += 1
        if seq.deadline_s is not None and seq.first_scheduled_s is None:
            self._next_deadline_s = min(self._next_deadline_s, seq.deadline_s)

    def push_front(self, seq: Sequence) -> None:
        """Queue a preempted sequence ahead of everyone (push victims newest first)."""
        self._resumed.appendleft(seq)
        self._num_seqs += 1

    def head(self) -> Sequence | None:
        """The next to admit; None when empty. Stays the head until it is popped or removed."""
        if self._resumed:
            return self._resumed[0]
        if not self._classes:
            return None
        return self._classes[self._choose(self._classes)].head()

    def pop_head(self) -> Sequence:
        """Remove and return :meth:`head` (it was admitted): the fairness counters move on."""
        if not self._num_seqs:
            raise IndexError("pop from an empty WaitQueue")
        self._num_seqs -= 1
        if self._resumed:
            return self._resumed.popleft()
        return self._take(self._classes, self._choose(self._classes))

    def remove(self, seq_id: int) -> Sequence | None:
        """Take out the waiting sequence *seq_id* (aborted); None if it is not waiting."""
        for seq in self._resumed:
            if seq.seq_id == seq_id:
                self._resumed.remove(seq)
                self._num_seqs -= 1
                return seq
        for seq in self._unordered():
            if seq.seq_id == seq_id:
                self._discard(seq)
                return seq
        return None

    def expire(self, now: float) -> list[Sequence]:
        """Remove and return the unstarted sequences whose deadline is at or before *now*."""
        if now < self._next_deadline_s:
            return []
        expired, next_deadline_s = [], math.inf
        for seq in list(self._unordered()):
            if seq.deadline_s is None or seq.first_scheduled_s is not None:
                continue
            if seq.deadline_s <= now:
                expired.append(seq)
            else:
                next_deadline_s = min(next_deadline_s, seq.deadline_s)
        for seq in expired:
            self._discard(seq)
        self._next_deadline_s = next_deadline_s
        return expired

    # -- the policy ------------------------------------------------------------

    def _choose(self, classes: dict[int, _Class]) -> int:
        """The class that serves next: the most urgent one passed over too often, else the most urgent."""
        priorities = sorted(classes)
        return next((p for p in priorities if classes[p].num_skips >= self.max_skips), priorities[0])

    @staticmethod
    def _take(classes: dict[int, _Class], chosen: int) -> Sequence:
        """Pop the head of class *chosen*; every less urgent class still waiting was passed over once more."""
        cls = classes[chosen]
        seq = cls.pop_head()
        cls.num_skips = 0
        for priority, other in classes.items():
            if priority > chosen:
                other.num_skips += 1
        if not cls.queues:
            del classes[chosen]
        return seq

    def _unordered(self) -> Iterator[Sequence]:
        for cls in self._classes.values():
            yield from cls

    def _discard(self, seq: Sequence) -> None:
        cls = self._classes[seq.priority]
        cls.remove(seq)
        self._num_seqs -= 1
        if not cls.queues:
            del self._classes[seq.priority]
