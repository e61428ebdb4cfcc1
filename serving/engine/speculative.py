"""Speculative decoding: guess a few tokens cheaply, check them in one forward of the model.

A decoding step of a small model on a CPU (or any model at small batch on a GPU) is bound by
reading the weights, not by arithmetic: a forward over 1 + k tokens costs little more than over
one. So a proposer guesses the next k tokens, the scheduler gives the sequence a step of 1 + k
tokens (its last token and the guesses, like a small prefill chunk), and the model's logits at
each of those positions say which guesses were right.

Proposers (``EngineConfig.speculative``):

* ``ngram`` (prompt lookup): the sequence's last n tokens (n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``) are looked up earlier in the sequence, prompt and retrieved context
  included; the tokens that followed the most recent earlier occurrence are the guess. No extra
  model; strong when the output copies from the input (summaries, RAG answers, edits).
* ``draft``: a smaller model with the same vocabulary runs k greedy steps, batched across the
  sequences, over its own paged KV cache.

Verification keeps the model's distribution exactly. Every one of the 1 + k rows is sampled the
way plain decoding would sample it: same penalties (counting the guesses before it as output),
same filters, the same uniform draw for output index i. Guesses are accepted while they equal
what was sampled; the first row that differs gives its sampled token instead, and when all k
match, row k + 1 gives one more. Both proposers are deterministic given the context: a one-hot
proposal q. Speculative rejection sampling with a one-hot q accepts guess d with probability
min(1, p(d) / q(d)) = p(d) and on rejection draws from max(0, p - q), i.e. p without d; drawing
x ~ p and accepting iff x == d has exactly that law. And since the draws are the ones plain
decoding makes, the output is *the same*, not just equally distributed: greedy speculative
output equals greedy output, and a seeded request gives the same tokens with or without it.

Speculation turns itself off for a step where more than ``speculative_max_batch`` sequences
decode (a large batch is already compute-bound: extra rows cost real time), and per request with
``SamplingParams.speculative = False``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from serving.engine.block_manager import BlockManager
from serving.engine.model_runner import ModelRunner
from serving.engine.models.llama import LlamaModel
from serving.engine.sampler import TokenLogprobs, greedy_ids
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import ScheduledSeq
from serving.engine.sequence import Sequence

#: How far back prompt lookup searches: the most recent tokens of the sequence.
LOOKUP_WINDOW = 8192

_DRAFT_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1 << 30)


@dataclass(slots=True)
class Guessed:
    """A sequence as it would be after accepting its first ``len(extra)`` guesses: what the sampler reads.

    Row j of a verified sequence is sampled from ``Guessed(seq, guesses[:j])``, so penalties count
    the earlier guesses as output and a seeded draw uses output index ``num_output_tokens + j``.
    """

    seq: Sequence
    extra: list[int]

    @property
    def sampling(self) -> SamplingParams:
        return self.seq.sampling

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.seq.eos_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)


def accepted_prefix(guesses: Seq[int], sampled: Seq[int]) -> int:
    """How many leading guesses equal the tokens sampled at their positions."""
    count = 0
    while count < len(guesses) and guesses[count] == sampled[count]:
        count += 1
    return count


def verify_rows(items: Seq[ScheduledSeq]) -> list[Sequence | Guessed]:
    """What the sampler reads for a step's sampling *items*: a row per item, plus one per guess. Row j of
    a verified decode is sampled as if its first j guesses were already accepted, which is exact: a guess
    is kept only when it equals the token sampled at its position (:func:`accept`)."""
    return [Guessed(item.seq, list(item.guesses[:j])) if j else item.seq
            for item in items for j in range(len(item.guesses) + 1)]


@dataclass(slots=True)
class Accepted:
    """The tokens a step adds to each sequence: the guesses confirmed, then the one sampled after them."""

    token_ids: dict[int, list[int]]
    logprobs: dict[int, list[TokenLogprobs | None]]
    #: (guesses verified, guesses accepted) per sequence that had guesses: the engine's speculation metrics.
    speculation: list[tuple[int, int]]


def accept(items: Seq[ScheduledSeq], token_ids: Seq[int], logprobs: Seq[TokenLogprobs | None]) -> Accepted:
    """Read the sampled rows of :func:`verify_rows` back per sequence, keeping each one's accepted prefix."""
    accepted = Accepted({}, {}, [])
    row = 0
    for item in items:
        num_rows = len(item.guesses) + 1
        tokens = token_ids[row:row + num_rows]
        num_accepted = accepted_prefix(item.guesses, tokens)
        accepted.token_ids[item.seq.seq_id] = list(tokens[:num_accepted + 1])
        accepted.logprobs[item.seq.seq_id] = list(logprobs[row:row + num_accepted + 1])
        if item.guesses:
            accepted.speculation.append((len(item.guesses), num_accepted))
        row += num_rows
    return accepted


class PromptLookup:
    """Guesses the continuation of the sequence's last n-gram from where it occurred before."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, num_tokens, strict=True)]

    def lookup(self, token_ids: Seq[int], k: int) -> list[int]:
        """Up to *k* tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = np.asarray(token_ids[-LOOKUP_WINDOW:], dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so each has a successor (and is not the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""


class DraftModel:
    """Guesses with a smaller model of the same vocabulary: k greedy steps over its own paged KV cache.

    Each draft sequence mirrors a target sequence's tokens. Before guessing, it catches up on
    whatever the target accepted since (a small prefill); guesses the target rejected leave stale
    keys and values past the common prefix, which the next catch-up overwrites.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._mirrors: dict[int, Sequence] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[list[int]]:
        mirrors = [self._sync(seq) for seq in seqs]
        row_of = {mirror.seq_id: i for i, mirror in enumerate(mirrors)}
        guesses: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        for round_index in range(max(num_tokens, default=0)):
            items = []
            for i in active:
                mirror = mirrors[i]
                num_new = mirror.num_uncomputed_tokens
                if not self.blocks.can_allocate(mirror, num_new):
                    continue  # the draft's pool is full: this sequence gets fewer guesses
                self.blocks.allocate(mirror, num_new)
                items.append(ScheduledSeq(mirror, num_new))
            if not items:
                break
            ordered = self.runner.order(items)
            next_ids = greedy_ids(self.runner.run(ordered))
            for item, token_id in zip(ordered, next_ids, strict=True):
                mirror = item.seq
                mirror.num_computed_tokens += item.num_new_tokens
                mirror.token_ids.append(token_id)
                guesses[row_of[mirror.seq_id]].append(token_id)
            active = [i for i in active if len(guesses[i]) == round_index + 1 and num_tokens[i] > round_index + 1]
        return guesses

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's mirror of *seq*, with the target's tokens and only still-valid KV counted as computed."""
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq.seq_id, [], 0, _DRAFT_SAMPLING)
            self._mirrors[seq.seq_id] = mirror
        common = _common_prefix(mirror.token_ids, seq.token_ids, mirror.num_prompt_tokens)
        mirror.token_ids = list(seq.token_ids)
        mirror.num_prompt_tokens = len(seq.token_ids)  # tokens known to be the target's, for the next sync
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, common, len(seq.token_ids) - 1)
        return mirror

    def release(self, seq_id: int) -> None:
        mirror = self._mirrors.pop(seq_id, None)
        if mirror is not None:
            self.blocks.free(mirror)



def _common_prefix(a: list[int], b: list[int], known: int) -> int:
    """Length of the common prefix of *a* and *b*, given that their first *known* tokens agree."""
    end = min(len(a), len(b))
    index = min(known, end)
    while index < end and a[index] == b[index]:
        index += 1
    return index


def check_draft(target: LlamaModel, draft: LlamaModel, target_tokenizer, draft_tokenizer) -> None:
    """Raise ValueError unless *draft* can guess for *target*: same vocabulary, same token ids."""
    if draft.shape.vocab_size != target.shape.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.shape.vocab_size} tokens, the model's "
                         f"{target.shape.vocab_size}: a draft must share the model's tokenizer")
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the model's")


def propose_counts(seqs: Seq[Sequence], num_speculative_tokens: int, max_model_len: int) -> list[int]:
    """How many tokens to guess for each sequence: never past its max_tokens or the context window.

    A step emits up to guesses + 1 tokens, so a sequence with r tokens left gets at most r - 1.
    """
    counts = []
    for seq in seqs:
        left = min(seq.sampling.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        counts.append(max(0, min(num_speculative_tokens, left - 1)))
    return counts
