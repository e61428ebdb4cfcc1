"""Who runs this step: continuous batching with chunked prefill and preemption.

Plain Python (no torch). Each step has a token budget
(``max_num_batched_tokens``) shared by decodes (one token each) and prefill
chunks. Running sequences are served first, in admission order; then waiting
ones are admitted in the order of the :class:`WaitQueue` (wait_queue.py):
preempted ones first, then by priority class (interactive before batch, batch
never starved), tenants taking turns within a class, first-in first-out within
a tenant. If the head does not fit in the KV cache, nobody overtakes it; it
retries next step. A waiting sequence still unadmitted at its ``deadline_s``
finishes as ``deadline`` before any prefill (a running one is never dropped
for its deadline). When the KV pool runs out, the most
recently admitted running sequence is preempted by recompute: its blocks are
freed and it goes back to the front of the queue (its prefix usually comes
back from the prefix cache on readmission).

A request for ``n`` sequences queues only its first; the other ``n - 1`` wait in its ``forks``. When
the step that computes its prompt's last token is done, they are forked from it: each shares its full
prompt blocks (one more reference each, with or without the prefix cache), recomputes the prompt's
last partial block on its own (at least one token: its first sample needs a forward), and goes to the
front of the queue. From there each is a sequence like any other: it samples, finishes, is preempted
or aborted on its own.

The engine step::

    output = scheduler.schedule()
    sampled = model_runner.run(output.scheduled)      # {seq_id: token_id}
    finished = scheduler.update(output, sampled)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineOverloaded
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.wait_queue import WaitQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute its next ``num_new_tokens`` tokens."""

    seq: Sequence
    num_new_tokens: int
    """Including the guesses: a verified decode is its last token plus ``len(guesses)``."""
    guesses: tuple[int, ...] = ()
    """Speculative decoding: tokens proposed to follow the sequence, checked by this step's forward."""
    samples: bool = field(init=False)
    """This step computes the sequence's last token, so a token is sampled for it (one per guess, plus one).

    Fixed at schedule time: ``update`` changes the counts it is derived from.
    """

    def __post_init__(self) -> None:
        num_real = self.num_new_tokens - len(self.guesses)
        object.__setattr__(self, "samples", self.seq.num_computed_tokens + num_real == self.seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, and who was preempted to make room for it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    """Finished while scheduling: alone, they outgrew the whole KV pool (``length``), or they were
    still waiting at their deadline (``deadline``).

    ``update`` returns them with the rest.
    """

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Picks each step's batch and applies its results.

    Call :meth:`abort` between steps, not while a scheduled batch is running:
    it frees the sequence's blocks at once.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids: frozenset[int]):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []
        """Admission order: the tail is the first to be preempted."""
        self._blocked_seq_id: int | None = None
        """The head of ``waiting`` that did not fit last time (its prefix lookup was counted)."""

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` for admission; raises EngineOverloaded when the queue is full."""
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(
                f"{len(self.waiting)} requests are waiting (max_waiting={self.config.max_waiting})",
                retry_after_s=1.0)
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch within the token budget; may preempt to free blocks."""
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # Admitting after a preemption would hand the victim's blocks straight
        # back (or admit someone else ahead of it): the pool is short this step.
        if not output.preempted:
            self._admit_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            guesses = self._guesses(seq, budget)
            if guesses:
                num_new += len(guesses)
            if num_new > 0 and self._make_room(seq, num_new, output):
                self.block_manager.allocate(seq, num_new)
                output.scheduled.append(ScheduledSeq(seq, num_new, guesses))
                budget -= num_new
            i += 1
        return budget

    def _guesses(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The speculative tokens to verify with ``seq``'s next decode: what the budget and free blocks allow.

        A guess never preempts anyone: without room for all of them, the sequence decodes plainly.
        """
        guesses, seq.guesses = seq.guesses, []
        if not guesses or seq.num_uncomputed_tokens != 1:
            return ()
        guesses = guesses[:budget - 1]
        if guesses and not self.block_manager.can_allocate(seq, 1 + len(guesses)):
            return ()
        return tuple(guesses)

    def _make_room(self, seq: Sequence, num_new: int, output: SchedulerOutput) -> bool:
        """Preempt from the tail of ``running`` until ``seq`` fits; False if ``seq`` itself went."""
        while not self.block_manager.can_allocate(seq, num_new):
            if len(self.running) == 1:
                # Alone with the whole pool and still short: preempting itself would
                # loop forever (it could never be readmitted), so it ends here.
                self.running.pop()
                output.finished += [seq, *self._finish(seq, "length")]
                logger.warning("sequence %d outgrew the KV cache (%d blocks); finished as length",
                               seq.seq_id, self.block_manager.num_blocks)
                return False
            # Victims come from the tail, after ``seq``: never one already scheduled.
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.push_front(seq)
        logger.debug("preempted sequence %d (preemption %d)", seq.seq_id, seq.num_preemptions)

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        self._drop_expired(output)
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.head()
            if not seq.block_table:
                manager.allocate_cached_prefix(seq, is_retry=seq.seq_id == self._blocked_seq_id)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not manager.can_allocate(seq, num_new):
                # Nobody overtakes the head the policy chose; it retries next step.
                manager.free(seq)
                seq.num_computed_tokens = 0
                self._blocked_seq_id = seq.seq_id
                return
            manager.allocate(seq, num_new)
            self.waiting.pop_head()
            self._blocked_seq_id = None
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = time.perf_counter()
            self.running.append(seq)
            output.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _drop_expired(self, output: SchedulerOutput) -> None:
        """Finish as ``deadline`` every waiting sequence never admitted whose deadline has passed."""
        for seq in self.waiting.expire(time.perf_counter()):
            if self._blocked_seq_id == seq.seq_id:
                self._blocked_seq_id = None
            output.finished += [seq, *self._finish(seq, "deadline")]
            logger.info("sequence %d dropped: still waiting at its deadline", seq.seq_id)

    def update(self, output: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Apply a step's results: advance computed counts, append sampled tokens, finish.

        ``sampled`` maps ``seq_id`` to the token sampled for each item that
        ``samples``, or for a verified decode to its tokens: the accepted
        guesses, then the token sampled after them. Returns the sequences that
        finished; their blocks are freed.
        """
        finished = list(output.finished)
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue  # aborted after schedule(); its blocks are already free
            seq.num_computed_tokens += item.num_new_tokens - len(item.guesses)
            reason = None
            if item.samples:
                tokens = sampled[seq.seq_id]
                for index, token_id in enumerate([tokens] if isinstance(tokens, int) else tokens):
                    if index:  # the token before this one was an accepted guess: this step computed its KV
                        seq.num_computed_tokens += 1
                    seq.token_ids.append(token_id)
                    reason = self._finish_reason(seq, token_id)
                    if reason is not None:
                        break
                if reason is None and seq.matcher is not None:
                    reason = self._append_forced(seq)
            self.block_manager.commit(seq)
            if item.samples and seq.forks:
                self._fork(seq)  # before a finish frees the blocks they share
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running[:] = [seq for seq in self.running if not seq.is_finished]
        return finished

    def _fork(self, parent: Sequence) -> None:
        """Queue *parent*'s forks, first in front, sharing its full prompt blocks."""
        num_shared = (parent.num_prompt_tokens - 1) // self.block_manager.block_size
        for child in reversed(parent.forks):
            if child.is_finished:
                continue  # aborted on its own before the fork
            self.block_manager.fork(parent, child, num_shared)
            child.num_cached_tokens = child.num_computed_tokens
            child.first_scheduled_s = parent.first_scheduled_s
            child.status = SequenceStatus.WAITING
            self.waiting.push_front(child)
        parent.forks.clear()

    def _append_forced(self, seq: Sequence) -> str | None:
        """Constrained decoding: append the tokens the constraint allows in one way only, unsampled.

        They are computed by the next step like a prompt chunk. Returns a finish reason if one ends the request.
        """
        for token_id in seq.matcher.forced():
            seq.token_ids.append(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                return reason
        return None

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sampling = seq.sampling
        if seq.matcher is not None:
            seq.matcher.advance(token_id)  # raises if the sampler broke the constraint: a bug, not input
            if seq.matcher.is_terminated():
                return "stop"  # complete, and nothing but EOS may follow
        if token_id in sampling.stop_token_ids:
            return "stop"
        if not sampling.ignore_eos and (token_id in self.eos_token_ids or token_id in seq.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= sampling.max_tokens:
            return "length"
        max_model_len = self.config.max_model_len
        if max_model_len is not None and seq.num_tokens >= max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> list[Sequence]:
        """Finish *seq* and free its blocks; its forks not queued yet end with it (they hold no blocks).
        Returns those forks."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        forks = [child for child in seq.forks if not child.is_finished]
        for child in forks:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason
        return forks

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a waiting or running sequence and free its blocks; None if unknown or done.

        Its forks not queued yet end with it (still listed in its ``forks``)."""
        seq = self.waiting.remove(seq_id)
        if seq is None:
            seq = next((s for s in self.running if s.seq_id == seq_id), None)
            if seq is None:
                return None
            self.running.remove(seq)
        if self._blocked_seq_id == seq_id:
            self._blocked_seq_id = None
        self._finish(seq, "abort")
        return seq
